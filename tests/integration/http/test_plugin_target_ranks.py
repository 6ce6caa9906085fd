"""A plugin target's ranks follow its ``/dp/gate`` answers: at most 1,024 per
target (an answer naming more is cut to its first 1,024), a rank missing from
``RANK_ABSENT_ANSWERS`` answers in a row dropped — a server that scaled down no longer pins the
fleet at ``unknown``, and a server naming new ranks every answer cannot grow the exporter.
Real sockets both ways: hostile gate servers (``tests/harness/hostile_api.py``) and the exporter
served over HTTP, the hostile target first, middle or last."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from exporter.client.http.plugin import MAX_ENGINES, RANK_ABSENT_ANSWERS
from tests.harness.hostile_api import HostileApi, gate_doc, sidecar_over
from tests.harness.scrape import parse_metrics, samples
from tests.harness.service import Service
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
GATE = "/dp/gate"


@contextlib.asynccontextmanager
async def sidecar(
    position: int, call_timeout: float = 1.0
) -> AsyncIterator[tuple[Service, HostileApi]]:
    """An exporter over three plugin targets ``t0..t2`` naming ranks 0 and 1; the test sets
    what the one at ``position`` answers (before its first poll: ranks 0 and 1 too)."""
    async with sidecar_over(
        lambda _, api: api.json(GATE, gate_doc([0, 1])),
        plugin=True,
        poll_interval=0.2,
        call_timeout=call_timeout,
    ) as (service, apis):
        yield service, apis[position]


def labels_of(run: Service, target: str) -> list[str]:
    return [label for label in run.exporter.client.engine_labels if label.startswith(target + "/")]


async def status(run: Service) -> dict[str, Any]:
    """``/status``, answered within a few seconds."""
    return await asyncio.wait_for(run.status(), 4)


async def engine_up_labels(run: Service) -> set[str]:
    """The engines ``/metrics`` carries a ``vllm_dp_engine_up`` for (scraped within seconds)."""
    families = parse_metrics(await asyncio.wait_for(run.metrics(), 4))
    return {s.labels["engine"] for s in samples(families, "vllm_dp_engine_up")}


@pytest.mark.parametrize("position", list(POSITIONS))
async def test_ranks_follow_a_server_that_scales_down_and_up(position: str) -> None:
    target = f"t{POSITIONS[position]}"
    four = [f"{target}/{r}" for r in range(4)]
    async with sidecar(POSITIONS[position]) as (run, api):
        api.json(GATE, gate_doc(range(4)))
        await eventually(lambda: labels_of(run, target) == four, 10, "four ranks named")
        await run.fresh_poll()
        assert (await status(run))["aggregate"]["is_sleeping"]["state"] == "consistent"

        # Scaled down to two ranks: ranks 2 and 3 are dropped, not kept as disconnected.
        asked = api.asked[GATE]
        api.json(GATE, gate_doc([0, 1]))
        await eventually(lambda: labels_of(run, target) == four[:2], 15, "ranks 2, 3 dropped")
        assert api.asked[GATE] - asked >= RANK_ABSENT_ANSWERS  # not at the first answer
        await run.fresh_poll()
        doc = await status(run)
        engines = [e["engine"] for e in doc["engines"]]
        assert not set(four[2:]) & set(engines), engines
        assert len(engines) == 6 and doc["engines_expected"] == 6
        assert doc["aggregate"]["is_sleeping"]["state"] == "consistent", doc["aggregate"]
        assert not set(four[2:]) & await engine_up_labels(run)
        gate_status, _ = await run.get_json("/gate?sleeping=false")
        assert gate_status == 200

        # Scaled up again: the ranks are back at the first answer naming them.
        api.json(GATE, gate_doc(range(4)))
        await eventually(lambda: labels_of(run, target) == four, 10, "four ranks again")


@pytest.mark.parametrize("position", list(POSITIONS))
async def test_a_server_naming_other_ranks_every_answer_stays_within_1024(position: str) -> None:
    """Each answer names other ranks, 700 or 5,000 of them: the target never has more than
    1,024 engines, and ``/status`` and ``/metrics`` keep answering within seconds."""
    target = f"t{POSITIONS[position]}"
    answers = itertools.count()

    def rotating() -> dict[str, Any]:
        n = next(answers)
        start = (n * 5000) % 90000
        return gate_doc(range(start, start + (5000 if n % 2 else 700)))

    async with sidecar(POSITIONS[position], call_timeout=2.0) as (run, api):
        api.json(GATE, rotating)
        asked = api.asked[GATE]
        most = 0
        deadline = asyncio.get_running_loop().time() + 30
        while api.asked[GATE] - asked < 8:  # eight answers, each naming other ranks
            most = max(most, len(labels_of(run, target)))
            assert most <= MAX_ENGINES, most
            assert asyncio.get_running_loop().time() < deadline, "eight gate answers"
            await asyncio.sleep(0.05)
        await run.fresh_poll()
        most = max(most, len(labels_of(run, target)))
        assert 0 < most <= MAX_ENGINES
        doc = await status(run)
        assert len(doc["engines"]) <= MAX_ENGINES + 4
        ups = await engine_up_labels(run)
        assert len([u for u in ups if u.startswith(target + "/")]) <= MAX_ENGINES
        # The counters of ranks that left end too: the label set stays bounded (E5).
        calls = {e for _, e, _ in run.exporter.stats.utility_calls if e.startswith(target + "/")}
        assert len(calls) <= MAX_ENGINES, len(calls)


async def test_an_answer_naming_more_than_1024_ranks_is_cut_to_its_first_1024() -> None:
    async with sidecar(POSITIONS["middle"], call_timeout=2.0) as (run, api):
        api.json(GATE, gate_doc(range(5000)))
        want = [f"t1/{r}" for r in range(MAX_ENGINES)]
        await eventually(lambda: labels_of(run, "t1") == want, 15, "the first 1,024 ranks")
        await run.fresh_poll()
        doc = await status(run)
        outcomes = {e["invariants"]["is_sleeping"]["outcome"] for e in doc["engines"]}
        assert outcomes == {"ok"} and len(doc["engines"]) == MAX_ENGINES + 4
        # A server answers for all its ranks at once: HTTP polls are never paced by engine
        # (1,028 engines in bursts of 16 would ask each server 65 times a poll).
        assert run.exporter.poller.engines_per_burst == 16 and run.exporter.poller.pace.bursts == 0


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize(
    "rank", ["\u00b2", "\u0661", "\uff11"], ids=["superscript", "arabic", "fullwidth"]
)
async def test_a_rank_that_is_not_ascii_digits_is_dropped_alone(
    position: str, rank: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A server naming rank "²" (``str.isdigit`` takes it, ``int()`` refuses it), or the
    Arabic-Indic or fullwidth one (``int()`` reads 1) beside its ranks 0 and 1: that entry is
    unreadable and dropped, ranks 0 and 1 read right (never the whole target down), no rank 1
    made of another, nothing logged at ERROR."""
    target = f"t{POSITIONS[position]}"
    doc = gate_doc([0, 1])
    doc["engines"].append({**doc["engines"][0], "engine": rank, "values": {"sleeping": True}})
    with caplog.at_level(logging.ERROR):
        async with sidecar(POSITIONS[position]) as (run, api):
            api.json(GATE, doc)
            asked = api.asked[GATE]
            await eventually(lambda: api.asked[GATE] - asked >= 3, 10, "three gate answers")
            await run.fresh_poll()
            assert labels_of(run, target) == [f"{target}/0", f"{target}/1"]
            status_doc = await status(run)
            mine = [e for e in status_doc["engines"] if e["engine"].startswith(target + "/")]
            assert [e["invariants"]["is_sleeping"]["value"] for e in mine] == [False, False]
            assert status_doc["aggregate"]["is_sleeping"]["state"] == "consistent"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
