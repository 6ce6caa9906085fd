"""In-process forward progress and ``stalled`` (docs/activity.md): vLLM's stat loggers tell the
exporter each rank's computed tokens (``exporter.inprocess.statlogger`` on a stand-in of vLLM's
base, called as vLLM's output handler calls it). A rank that holds the front end's requests
and says it has work (a simulated engine whose scheduler holds requests) but computes nothing
reads ``stalled`` after ``--stall-after``, is not routable and is published so; the rank that
keeps computing never is, and the stalled one reads awake again once it computes. Real ZMQ
engines behind the simulated ``AsyncLLM``, the exporter embedded with ``start_exporter`` and
read over real HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from exporter.client.inprocess.feed import FEED
from tests.harness.inprocess import EmbeddedExporters, SimVllm, holding, read_status
from tests.harness.inprocess import TokenStats as Stats
from tests.harness.scrape import metric_value

STALL_S = 1.0
WAIT_S = 15.0
LONG_S = 600.0


async def test_a_rank_that_holds_requests_and_computes_nothing_reads_stalled(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, stat_logger: Any
) -> None:
    service = await embedded(sim_vllm.llm, stall_after=STALL_S)
    holding(sim_vllm, 1, 2)  # rank 1: its scheduler holds them, computing nothing
    holding(sim_vllm, 2, 1)  # rank 2: computes
    sim_vllm.engines[1].state.work.stuck = True
    deadline = time.monotonic() + WAIT_S
    while True:
        stat_logger.record(None, Stats(8, 0), engine_idx=2)  # vLLM's output path, per step
        doc, metrics = await read_status(service)
        states = [e["state"] for e in doc["engines"]]
        if states == ["awake", "stalled", "awake"]:
            break
        assert time.monotonic() < deadline, f"rank 1 never stalled: {states}"
        await asyncio.sleep(0.1)
    one, two = doc["engines"][1], doc["engines"][2]
    assert one["routable"]["routable"] is False
    assert one["routable"]["reasons"][0].startswith("stalled: holds requests, no token computed")
    assert one["progress"]["tokens"] == 0 and one["progress"]["held"] == 2
    assert one["progress"]["age_seconds"] >= STALL_S and one["progress"]["source"] == "stat_logger"
    assert two["progress"]["tokens"] >= 8 and two["routable"]["routable"] is True
    assert metric_value(metrics, "vllm_dp_engine_state", engine="1", state="stalled") == 1.0
    assert metric_value(metrics, "vllm_dp_engine_state", engine="2", state="stalled") == 0.0
    assert metric_value(metrics, "vllm_dp_engine_routable", engine="1") == 0.0
    assert metric_value(metrics, "vllm_dp_engine_progress_tokens_total", engine="1") == 0.0
    made = metric_value(metrics, "vllm_dp_engine_progress_tokens_total", engine="2")
    assert made is not None and made >= 8.0
    age = metric_value(metrics, "vllm_dp_engine_last_progress_age_seconds", engine="1")
    assert age is not None and age >= STALL_S
    # It computes again: awake and routable at the next poll.
    stat_logger.record(None, Stats(0, 120), engine_idx=1)  # a prefill completed
    doc, metrics = await read_status(service)
    assert doc["engines"][1]["state"] == "awake" and doc["engines"][1]["routable"]["routable"]
    assert doc["engines"][1]["progress"]["tokens"] == 120


async def test_an_idle_rank_given_work_is_not_stalled_before_stall_after_from_then(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, stat_logger: Any
) -> None:
    """Idle past ``--stall-after`` (its last token long ago), rank 1 gets requests it has not
    computed on yet (a long prefill): the stall clock starts when the work came, not at the
    last token, so it reads awake first and stalled only ``--stall-after`` later."""
    stall_s = 3.0
    service = await embedded(sim_vllm.llm, stall_after=stall_s)
    deadline = time.monotonic() + WAIT_S
    while True:  # every rank idle for longer than --stall-after
        doc, _ = await read_status(service)
        if min(e["progress"]["age_seconds"] for e in doc["engines"]) > stall_s:
            break
        assert time.monotonic() < deadline, doc["engines"]
        await asyncio.sleep(0.2)
    assert [e["progress"]["held_since_unix"] for e in doc["engines"]] == [None, None, None]
    holding(sim_vllm, 1, 1)
    sim_vllm.engines[1].state.work.stuck = True
    doc, _ = await read_status(service)  # the first poll that saw the work
    one = doc["engines"][1]
    assert one["state"] == "awake" and one["routable"]["routable"], one
    assert one["progress"]["held"] == 1 and one["progress"]["age_seconds"] > stall_s, one
    came = one["progress"]["held_since_unix"]
    assert isinstance(came, float), one
    deadline = time.monotonic() + WAIT_S
    while one["state"] != "stalled":
        assert time.monotonic() < deadline, f"rank 1 never stalled: {one}"
        await asyncio.sleep(0.2)
        doc, _ = await read_status(service)
        one = doc["engines"][1]
        assert one["progress"]["held_since_unix"] == came, one  # one stretch of work
    assert time.time() - came >= stall_s


async def test_a_paused_or_idle_rank_is_never_stalled_and_no_stat_logger_is_unknown(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, stat_logger: Any
) -> None:
    service = await embedded(sim_vllm.llm, stall_after=STALL_S)
    holding(sim_vllm, 0, 2)
    await sim_vllm.direct_call("pause_scheduler", 0, "keep")  # the operator's pause
    deadline = time.monotonic() + WAIT_S
    while True:  # until a poll saw every rank past --stall-after without a token
        doc, _ = await read_status(service)
        if min(e["progress"]["age_seconds"] for e in doc["engines"]) > STALL_S:
            break
        assert time.monotonic() < deadline, doc["engines"]
        await asyncio.sleep(0.1)
    assert [e["state"] for e in doc["engines"]] == ["paused", "awake", "awake"]
    assert [e["progress"]["tokens"] for e in doc["engines"]] == [0, 0, 0]
    FEED.detach()  # vLLM built no stat logger of ours (VLLM_PLUGINS left it out)
    doc, metrics = await read_status(service)
    assert [e["progress"] for e in doc["engines"]] == [None, None, None]
    assert metric_value(metrics, "vllm_dp_engine_progress_tokens_total", engine="0") is None
