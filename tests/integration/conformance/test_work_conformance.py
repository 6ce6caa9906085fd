"""Is this rank doing anything? ``has_work`` in every attach mode (docs/activity.md), through
the exporter's own HTTP surface over each kind's real client (``serve_kind``): a rank given
requests (its simulated scheduler runs them) has work in the snapshot, ``/status`` and
``vllm_dp_engine_has_work`` while its neighbours do not, and drains when they are done; a rank
whose ``has_work`` is hung, failed, unsupported or hostile is unknown (null), never drained,
and the gate's ``drained=true`` names it (501 when no rank has the method); ranks that differ
in their work are no inconsistency. ``POST /admin/pause?mode=wait`` answers once the running
requests finished and names a rank that got a request queued meanwhile; ``mode=abort`` drops
the work; ``sleep?mode=wait`` drains too. Where the mode publishes request counts (in-process
and relay: the DP coordinator's, simulated; HTTP: ``/metrics``; a plugin-enabled server: its
``/dp/gate``) they are checked too. Every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from exporter.client.observe import WORK_COUNTS
from exporter.fleetstate.snapshot import FleetSnapshot
from tests.harness.fleet_kinds import ENGINES, FleetKind, ServedKind, serve_kind
from tests.harness.scrape import Families, metric_value, samples
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(90)

WAIT_S = 15.0
#: Requests that outlive any test (finished by ``finish_work``).
LONG_S = 600.0
#: A request that is still running when a pause reaches its engine (the pause waits for it).
RUN_S = 2.0
#: The admin actions' deadline (a pause's wait, then the read-back's).
ACTION_S = 3.0
HUNG_AFTER_S = 1.0
POSITIONS = {"first": 0, "middle": 1, "last": 2}


@pytest.fixture
async def served(fleet_kind: FleetKind) -> AsyncIterator[ServedKind]:
    served = await serve_kind(
        fleet_kind, call_timeout=1.0, action_timeout=ACTION_S, hung_after=HUNG_AFTER_S
    )
    yield served
    await served.close()


def counted(kind: FleetKind) -> bool:
    """Whether the mode publishes each rank's running and waiting requests."""
    return kind.client.capabilities.request_counts


def listens(kind: FleetKind) -> bool:
    """Whether the mode's polls take ``has_work`` from live request counts, asking it only
    where they cannot tell (in-process: docs/activity.md, a listening poll)."""
    return kind.client.observations.knows(WORK_COUNTS)


async def polled_until(
    served: ServedKind, until: Callable[[FleetSnapshot], bool], what: str
) -> FleetSnapshot:
    """Fresh polls until ``until(snapshot)`` holds (bounded: ``WAIT_S``)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        await served.fresh_poll()
        snap = served.exporter.poller.snapshot
        if until(snap):
            return snap
        if asyncio.get_running_loop().time() > deadline:
            seen = [(e.state, e.has_work, e.requests) for e in snap.engines]
            raise AssertionError(f"never {what} within {WAIT_S}s: {seen}")
        await asyncio.sleep(0.05)


def inconsistencies(served: ServedKind, m: Families) -> float:
    found = samples(m, "vllm_dp_inconsistent_utility_results_total")
    assert sum(s.value for s in found) == sum(served.exporter.stats.inconsistent_results.values())
    return sum(s.value for s in found)


def needs_scheduler(kind: FleetKind) -> None:
    """Skip (saying why) a kind whose admin actions cannot pause a simulated scheduler."""
    if kind.name == "fake":
        pytest.skip("the fake's engines answer from a handler: no scheduler pauses or drains")
    if kind.name == "http_plugin":
        pytest.skip(
            "a plugin-enabled server runs admin actions on its own POST /dp/admin/<action>: the "
            "sidecar sends none (tests/integration/inprocess covers the plugin's)"
        )


# -- has_work every poll ----------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_given_work_has_it_alone_then_drains(
    fleet_kind: FleetKind, served: ServedKind, position: int
) -> None:
    labels = fleet_kind.labels
    before = served.exporter.stats.inconsistent_results.copy()
    await fleet_kind.give_work(position, LONG_S, count=2)
    busy = [i == position for i in range(ENGINES)]

    def shows_work(s: FleetSnapshot) -> bool:
        if [e.has_work for e in s.engines] != busy:
            return False
        counts = s.engines[position].requests
        return not counted(fleet_kind) or (counts is not None and counts.running == 2)

    snap = await polled_until(served, shows_work, "the rank's work seen")
    assert all(e.outcomes["has_work"].ok for e in snap.engines)  # read by the poll, every rank
    assert [e.drained for e in snap.engines] == [not b for b in busy]
    doc = await served.status()
    validate_status(doc)
    activity = [e["activity"] for e in doc["engines"]]
    assert [a["has_work"] for a in activity] == busy
    assert [a["drained"] for a in activity] == [not b for b in busy]
    if counted(fleet_kind):
        assert (activity[position]["running"], activity[position]["waiting"]) == (2, 0)
    else:  # owner and relay mode publish no counts
        assert all(a["running"] is None and a["waiting"] is None for a in activity)
    m = await served.scrape()
    assert [metric_value(m, "vllm_dp_engine_has_work", engine=e) for e in labels] == [
        float(b) for b in busy
    ]
    running = metric_value(m, "vllm_dp_engine_requests", engine=labels[position], state="running")
    assert running == (2.0 if counted(fleet_kind) else None)
    # Ranks differ in their work by design: no inconsistency, and the fleet is consistent.
    assert served.exporter.stats.inconsistent_results == before
    assert inconsistencies(served, m) == sum(before.values())
    assert doc["aggregate"]["is_sleeping"]["state"] == "consistent"

    await fleet_kind.finish_work(position)
    snap = await polled_until(
        served, lambda s: all(e.drained for e in s.engines), "every rank drained"
    )
    assert [e.has_work for e in snap.engines] == [False] * ENGINES
    doc = await served.status()
    assert all(e["activity"]["drained"] is True for e in doc["engines"])
    m = await served.scrape()
    assert [metric_value(m, "vllm_dp_engine_has_work", engine=e) for e in labels] == [0.0] * 3
    assert served.exporter.stats.inconsistent_results == before


async def test_requests_that_run_out_drain_the_rank_by_themselves(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    await fleet_kind.give_work(1, 0.5)
    await eventually(lambda: fleet_kind.counts(1) == (0, 0), WAIT_S, "the request done")
    snap = await polled_until(
        served, lambda s: all(e.drained for e in s.engines), "every rank drained"
    )
    assert snap.engines[1].has_work is False


# -- has_work that cannot be read -------------------------------------------------------------

#: fault → (position, what the hook is given).
FAULTS: dict[str, tuple[int, Any]] = {
    "hung": (0, None),
    "failed": (1, "RuntimeError: scheduler state unavailable"),
    "unsupported": (2, None),
    "string": (0, "yes"),
    "integer": (1, 1),
    "none": (2, None),
    "list": (0, [False]),
}


async def break_has_work(kind: FleetKind, fault: str, i: int, given: Any) -> None:
    if fault == "hung":
        await kind.hang(i)
    elif fault == "failed":
        await kind.fail_has_work(i, given)
    elif fault == "unsupported":
        await kind.lack(i, "has_work")
    else:
        await kind.answer_has_work(i, given)


@pytest.mark.parametrize("fault", FAULTS)
async def test_a_rank_whose_has_work_cannot_be_read_is_unknown_never_drained(
    fleet_kind: FleetKind, served: ServedKind, fault: str
) -> None:
    position, given = FAULTS[fault]
    me = fleet_kind.labels[position]
    await break_has_work(fleet_kind, fault, position, given)
    if listens(fleet_kind) and fault != "hung":
        # The polls ask no rank has_work: its counts (0) tell it idle, as they tell the others.
        # Only the gate, which asks every rank afresh, meets the broken answer (below).
        await polled_until(served, lambda s: all(e.drained for e in s.engines), "all told idle")
        doc = await served.status()
        validate_status(doc)
        mine = doc["engines"][position]["activity"]
        assert (mine["has_work"], mine["has_work_read"], mine["drained"]) == (False, "told", True)
    else:
        snap = await polled_until(
            served,
            lambda s: (
                s.engines[position].has_work is None
                and all(e.has_work is False for i, e in enumerate(s.engines) if i != position)
            ),
            f"rank {me}'s has_work unknown",
        )
        assert not snap.engines[position].drained
        doc = await served.status()
        validate_status(doc)
        mine = doc["engines"][position]["activity"]
        assert (mine["has_work"], mine["drained"]) == (None, None), mine
        others = [e["activity"] for i, e in enumerate(doc["engines"]) if i != position]
        assert all(a["has_work"] is False and a["drained"] is True for a in others), others
        m = await served.scrape()  # the exporter keeps serving
        assert metric_value(m, "vllm_dp_engine_has_work", engine=me) is None
        for i, label in enumerate(fleet_kind.labels):
            if i != position:
                assert metric_value(m, "vllm_dp_engine_has_work", engine=label) == 0.0
        assert inconsistencies(served, m) == 0
    code, body = await served.gate("drained=true")
    assert code == 412 and body["failing_engines"] == [me], body
    (failure,) = [f for f in body["engines"][position]["failures"] if f.startswith("drained")]
    why = ("hung", "sleeping: ") if fault == "hung" else ("has_work: ",)
    assert failure.startswith(tuple(f"drained: unknown, {w}" for w in why)), failure
    assert body["engines"][position]["values"]["drained"] is None


async def test_drained_is_unsupported_when_no_rank_has_has_work(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    for i in range(ENGINES):
        await fleet_kind.lack(i, "has_work")
    told = listens(fleet_kind)  # its polls ask no rank has_work: the counts tell them idle
    await polled_until(
        served,
        lambda s: all(e.has_work is (False if told else None) for e in s.engines),
        "has_work told" if told else "has_work unknown",
    )
    code, body = await served.gate("drained=true")
    assert code == 501 and body["unsupported"] == ["drained"], body
    await served.fresh_poll()  # after the gate learnt the method is missing: still told
    doc = await served.status()
    assert all(e["activity"]["drained"] is (True if told else None) for e in doc["engines"])
    assert (await served.gate("sleeping=false"))[0] == 200  # the other conditions still work


# -- the gate ---------------------------------------------------------------------------------


async def test_the_gate_names_each_rank_with_work_then_opens_after_the_drain(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    labels = fleet_kind.labels
    await fleet_kind.give_work(0, LONG_S)
    await fleet_kind.give_work(2, LONG_S, count=2)
    expected = {
        0: "drained: has work (running 1, waiting 0), expected drained=true",
        2: "drained: has work (running 2, waiting 0), expected drained=true",
    }
    if not counted(fleet_kind):
        expected = dict.fromkeys(expected, "drained: has work, expected drained=true")
    found: list[dict[str, Any]] = []

    async def names_them() -> bool:
        code, body = await served.gate("drained=true")
        found[:] = [body]
        assert code == 412 and body["failing_engines"] == [labels[0], labels[2]], body
        return all(body["engines"][i]["failures"] == [f] for i, f in expected.items())

    await eventually_async(names_them, "the gate naming both ranks' work")
    (body,) = found
    if counted(fleet_kind):
        assert body["engines"][2]["requests"] == {"running": 2, "waiting": 0}
        assert body["engines"][1]["requests"] == {"running": 0, "waiting": 0}
    else:
        assert all(e["requests"] is None for e in body["engines"])
    code, body = await served.gate("drained=false")
    assert code == 412 and body["failing_engines"] == [labels[1]]
    assert body["engines"][1]["failures"] == ["drained: no work, expected drained=false"]

    await fleet_kind.finish_work(0)
    await fleet_kind.finish_work(2)
    await eventually_async(
        lambda: gate_code(served, "drained=true", 200), "the gate open after the drain"
    )
    code, body = await served.gate("drained=false")
    assert code == 412 and body["failing_engines"] == labels
    for query in ("drained=maybe", "drained=true&drained=true", "drained="):
        code, body = await served.gate(query)
        assert code == 400 and "drained" in body["error"], (query, body)


async def gate_code(served: ServedKind, query: str, wanted: int) -> bool:
    return (await served.gate(query))[0] == wanted


async def eventually_async(check: Callable[[], Any], what: str) -> None:
    """``await check()`` until it is true (bounded)."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        await asyncio.sleep(0.05)


# -- actions that wait for the work -----------------------------------------------------------


def verdicts(body: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(e["reason"], e["error"]) for e in body["engines"]]


async def test_pause_wait_answers_after_the_running_requests_and_names_queued_work(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    needs_scheduler(fleet_kind)
    await fleet_kind.give_work(0, RUN_S)
    pause = asyncio.ensure_future(served.post("pause", "mode=wait"))
    await eventually(
        lambda: fleet_kind.paused(1) and fleet_kind.paused(2), WAIT_S, "ranks 1 and 2 paused"
    )
    await fleet_kind.give_work(1, LONG_S)  # arrives while paused: queued
    code, body = await asyncio.wait_for(pause, WAIT_S + ACTION_S)
    assert fleet_kind.counts(0) == (0, 0), "the pause answered before rank 0's request ended"
    assert fleet_kind.counts(1) == (0, 1)
    assert code == 502 and body["outcome"] == "partial_failure", body
    assert [e["state"] for e in body["engines"]] == [True] * ENGINES  # every rank paused
    (first, queued, last) = verdicts(body)
    assert first == (None, None) and last == (None, None), body
    assert queued[0] == "unverified", body
    said = " (running 0, waiting 1)" if counted(fleet_kind) else ""
    assert queued[1] == f"paused, but it still has work{said}", body
    assert body["failed_engines"] == [body["engines"][1]["engine"]]


async def test_pause_wait_without_queued_work_verifies_every_rank(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    needs_scheduler(fleet_kind)
    await fleet_kind.give_work(0, RUN_S)
    code, body = await asyncio.wait_for(served.post("pause", "mode=wait"), WAIT_S + ACTION_S)
    assert fleet_kind.counts(0) == (0, 0)
    assert code == 200 and body["success"] and body["verified"], body
    assert verdicts(body) == [(None, None)] * ENGINES
    assert all(fleet_kind.paused(i) for i in range(ENGINES))


async def test_pause_abort_drops_the_work_and_is_verified(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    needs_scheduler(fleet_kind)
    await fleet_kind.give_work(0, LONG_S, count=2)
    await fleet_kind.give_work(2, LONG_S)
    code, body = await asyncio.wait_for(served.post("pause", "mode=abort"), WAIT_S)
    assert code == 200 and body["success"], body
    assert [fleet_kind.counts(i) for i in range(ENGINES)] == [(0, 0)] * ENGINES
    await polled_until(served, lambda s: all(e.drained for e in s.engines), "every rank drained")


async def test_sleep_wait_drains_before_it_answers(
    fleet_kind: FleetKind, served: ServedKind
) -> None:
    needs_scheduler(fleet_kind)
    await fleet_kind.give_work(1, RUN_S)
    code, body = await asyncio.wait_for(served.post("sleep", "mode=wait"), WAIT_S + ACTION_S)
    assert fleet_kind.counts(1) == (0, 0)
    assert code == 200 and body["success"] and body["verified"], body
    assert [e["state"] for e in body["engines"]] == [True] * ENGINES  # asleep
