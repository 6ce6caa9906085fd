"""A listening poll (docs/activity.md, "What each mode listens to"): in-process, each rank's
activity is what its live request counts tell (the DP coordinator's table raised to the front
end's own count), so a poll asks no engine ``has_work`` while they tell it. It asks a rank
whose counts cannot tell (its own count unreadable: first, middle and last rank), and a stall
candidate, which reads ``stalled`` only on its engine's own answer. The gate and an action
still ask every engine. Real ZMQ engines behind the simulated ``AsyncLLM``, the exporter
embedded with ``start_exporter`` and read over real HTTP; the calls counted by each engine,
at once and paced."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from exporter.web.app import RunningService
from tests.harness.inprocess import (
    EmbeddedExporters,
    SimVllm,
    coordinate,
    holding,
    http_session,
    read_activity,
    read_status,
)
from tests.harness.inprocess import TokenStats as Stats

WAIT_S = 15.0
LONG_S = 600.0
POLLS = 4

#: ``--stall-after`` of the tests that look for stalls.
STALL_S = 1.0


def asked(sim: SimVllm, method: str = "has_work") -> list[int]:
    """How often each engine has been asked ``method`` so far."""
    return [e.calls_by_method.get(method, 0) for e in sim.engines]


def grown(sim: SimVllm, before: list[int], method: str = "has_work") -> list[int]:
    """How often each engine has been asked ``method`` since ``before``."""
    return [n - b for n, b in zip(asked(sim, method), before, strict=True)]


async def polls(service: RunningService, count: int = POLLS) -> list[dict[str, Any]]:
    """``count`` fresh polls; the activity of the last."""
    activity: list[dict[str, Any]] = []
    for _ in range(count):
        activity, _ = await read_activity(service)
    return activity


async def test_a_listening_poll_asks_no_engine_has_work_while_the_counts_tell(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    sim_vllm.engines[1].state.submit(LONG_S, time.monotonic(), count=2)
    await polls(service, 2)  # the coordinator's first publication is in
    before, sleeping = asked(sim_vllm), asked(sim_vllm, "is_sleeping")
    activity = await polls(service)
    assert asked(sim_vllm) == before  # not one has_work call in POLLS polls
    assert min(grown(sim_vllm, sleeping, "is_sleeping")) >= POLLS
    assert [(a["has_work"], a["has_work_read"], a["drained"]) for a in activity] == [
        (False, "told", True),
        (True, "told", False),
        (False, "told", True),
    ]
    # The gate's drained condition still asks every engine afresh.
    async with http_session() as session:
        async with session.get(service.url + "/gate", params={"drained": "true"}) as resp:
            body = await resp.json()
    assert resp.status == 412 and body["failing_engines"] == ["1"], body
    assert grown(sim_vllm, before) == [1, 1, 1]


@pytest.mark.parametrize("rank", [0, 1, 2], ids=["first", "middle", "last"])
async def test_a_rank_whose_own_count_cannot_be_read_is_asked_and_never_drained(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, rank: int
) -> None:
    """Its counts cannot tell (the table alone misses what a keep-mode pause holds): that
    rank alone is asked ``has_work``, and its false answer without a count is no drained."""
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    sim_vllm.core.engine_inflight[sim_vllm.core.core_engines[rank]] = -3  # not a count
    await polls(service, 2)
    before = asked(sim_vllm)
    activity = await polls(service)
    grew = grown(sim_vllm, before)
    assert grew[rank] >= POLLS and sum(grew) == grew[rank], grew
    assert activity[rank]["has_work"] is None and activity[rank]["drained"] is None
    others = [a for i, a in enumerate(activity) if i != rank]
    assert [(a["has_work_read"], a["drained"]) for a in others] == [("told", True)] * 2


@pytest.mark.parametrize("per_burst", [0, 1], ids=["at_once", "paced"])
async def test_a_stall_candidate_is_asked_and_stalls_only_on_its_engines_answer(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, stat_logger: Any, per_burst: int
) -> None:
    """Rank 1's engine holds requests and computes nothing: a candidate, asked, stalled.
    Rank 0's front end counts a request its engine does not hold (its last output not yet
    read): a candidate too, but its engine says it has no work: never stalled, not drained.
    Paced one engine per burst, both are in a burst before the last (the one that reads the
    poll's progress): asked all the same."""
    service = await embedded(sim_vllm.llm, stall_after=STALL_S, engines_per_burst=per_burst)
    coordinate(sim_vllm)
    holding(sim_vllm, 1, 2)
    sim_vllm.engines[1].state.work.stuck = True
    sim_vllm.core.engine_inflight[sim_vllm.core.core_engines[0]] = 1
    deadline = time.monotonic() + WAIT_S
    while True:
        stat_logger.record(None, Stats(8, 0), engine_idx=2)  # rank 2 computes (idle)
        doc, _ = await read_status(service)
        states = [e["state"] for e in doc["engines"]]
        if states[1] == "stalled":
            break
        assert time.monotonic() < deadline, f"rank 1 never stalled: {states}"
        await asyncio.sleep(0.1)
    assert states == ["awake", "stalled", "awake"], states
    before = asked(sim_vllm)
    for _ in range(POLLS):
        stat_logger.record(None, Stats(8, 0), engine_idx=2)
        doc, _ = await read_status(service)
    grew = grown(sim_vllm, before)
    assert grew[0] >= POLLS and grew[1] >= POLLS and grew[2] == 0, grew
    zero, one = (e["activity"] for e in doc["engines"][:2])
    assert (zero["has_work"], zero["has_work_read"], zero["drained"]) == (False, "asked", False)
    assert (one["has_work"], one["has_work_read"]) == (True, "asked")
    assert [e["state"] for e in doc["engines"]] == ["awake", "stalled", "awake"]
