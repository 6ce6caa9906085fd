"""``exporter/control/poller.py`` over the in-memory ``FakeFleet``: the snapshot before and
after polls, republishing what engines pushed without asking them, methods nobody has, the
engines that left, and the loop (``poll_soon``, a poll that raises). The fleet verdicts
themselves are in tests/unit/control/test_fleet_semantics.py, the rate-limited
inconsistency warning in tests/unit/protocol/test_engine_strings.py."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from exporter.client.fake import answers
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.counted import CountedFleet
from exporter.control.poller import Poller
from exporter.fleetstate.aggregate import FleetState
from exporter.metrics.stats import Stats
from exporter.protocol.pushes import FaultStatus
from tests.harness.clock import ManualClock
from tests.harness.fakefleets import ReportingFleet, awake, fleet_of

ENGINES = ("0", "1", "2")


def poller_over(fleet: Any, stats: Stats | None = None, **options: Any) -> Poller:
    options.setdefault("interval_s", 60.0)
    return Poller(fleet, stats or Stats(), call_timeout_s=1.0, **options)


def test_before_the_first_poll_every_engine_is_unknown_and_nobody_was_asked() -> None:
    fleet = fleet_of(awake(ENGINES), disconnected={"2"})
    snap = poller_over(fleet).snapshot
    assert (snap.poll_number, snap.expected, snap.connected) == (0, 3, 2)
    assert [e.state for e in snap.engines] == ["unknown"] * 3
    assert [e.detail.connected for e in snap.engines] == [True, True, False]
    assert {v.state for v in snap.verdicts.values()} == {FleetState.UNKNOWN}
    assert not snap.ready and fleet.calls == []


async def test_each_poll_is_published_whole_with_the_next_number() -> None:
    wall = ManualClock(1000.0)
    stats = Stats()
    poller = poller_over(fleet_of(awake(ENGINES)), stats, wall_clock=wall)
    first = await poller.poll_once()
    wall.now = 1005.0
    second = await poller.poll_once()
    assert (first.poll_number, second.poll_number) == (1, 2)
    assert (first.taken_at_unix, second.taken_at_unix) == (1000.0, 1005.0)
    assert poller.snapshot is second and first.ready
    assert stats.polls == 2
    (bucket,) = poller.history.entries()
    assert bucket.polls == 2 and bucket.states["is_sleeping"] == "consistent"


async def test_republish_shows_what_engines_pushed_without_asking_any_engine() -> None:
    fleet = ReportingFleet(answers(awake(ENGINES)), engines=ENGINES)
    poller = poller_over(fleet)
    poller.republish()  # before the first poll there is nothing to republish
    assert poller.republished == 0
    polled = await poller.poll_once()
    asked = len(fleet.calls)
    fleet.fault_status["1"] = FaultStatus("unhealthy", "RuntimeError", 7.0)
    poller.republish()
    snap = poller.snapshot
    assert poller.republished == 1 and len(fleet.calls) == asked
    assert snap.poll_number == polled.poll_number and snap.taken_at_unix == polled.taken_at_unix
    assert snap.faulty == ("1",) and polled.faulty == ()
    assert snap.engines[1].outcomes == polled.engines[1].outcomes


async def test_a_burst_of_pushes_is_republished_once_per_loop_turn() -> None:
    fleet = ReportingFleet(answers(awake(ENGINES)), engines=ENGINES)
    poller = poller_over(fleet)
    await poller.poll_once()
    for n in range(100):  # a flood read in one go: the last status is what gets published
        fleet.fault_status["1"] = FaultStatus("unhealthy", f"E{n}", 7.0)
        poller.republish_soon()
    assert poller.republished == 0  # nothing copied while the flood is read
    await asyncio.sleep(0)  # one turn of the loop
    assert poller.republished == 1
    ft = poller.snapshot.engines[1].detail.fault_status
    assert ft is not None and ft.fault_info == "E99"


async def test_a_method_every_engine_lacks_is_unknown_without_an_error() -> None:
    values = awake(ENGINES)
    for per_engine in values.values():
        del per_engine["get_weight_version"]
    fleet = fleet_of(values)
    poller = poller_over(fleet)
    await poller.poll_once()
    snap = await poller.poll_once()
    verdict = snap.weight_version
    assert verdict.state is FleetState.UNKNOWN and verdict.error is None
    assert all(e.unsupported == {"get_weight_version"} for e in snap.engines)
    assert [e for e, m, _ in fleet.calls if m == "get_weight_version"] == list(ENGINES)  # once
    assert snap.ready  # an older vLLM is not a fault


async def test_a_method_the_attach_mode_does_not_ask_is_left_out_of_the_snapshot() -> None:
    fleet = fleet_of(awake(ENGINES), unsupported=frozenset({"is_scheduler_paused"}))
    snap = await poller_over(fleet).poll_once()
    assert "is_scheduler_paused" not in snap.verdicts
    assert snap.paused.state is FleetState.UNKNOWN
    assert [e.paused for e in snap.engines] == [None] * 3
    assert all(m != "is_scheduler_paused" for _, m, _ in fleet.calls)


async def test_an_engine_keeps_its_last_success_while_its_polls_fail() -> None:
    silent: set[str] = set()
    values = awake(ENGINES)

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if engine in silent:
            return EngineOutcome(engine, Outcome.TIMEOUT, error="no reply within 1s")
        return values[engine][method]

    fleet = fleet_of(values)
    fleet.handler = handler
    wall = ManualClock(1000.0)
    poller = poller_over(fleet, wall_clock=wall)
    await poller.poll_once()
    silent.add("1")
    wall.now = 1010.0
    snap = await poller.poll_once()
    assert [e.last_success_unix for e in snap.engines] == [1010.0, 1000.0, 1010.0]
    assert not snap.engines[1].up and snap.sleeping.state is FleetState.UNKNOWN


async def test_engines_that_left_the_fleet_are_forgotten() -> None:
    stats = Stats()
    values = awake(ENGINES)
    fleet = fleet_of(values)
    poller = poller_over(CountedFleet(fleet, stats), stats)
    await poller.poll_once()
    stats.record_confirmed_resets(["2"], "reset_prefix_cache", 1.0)
    assert {engine for _, engine, _ in stats.utility_calls} == set(ENGINES)
    fleet.engines = ("0", "1")  # a plugin-enabled server stopped naming rank 2
    snap = await poller.poll_once()
    assert [e.engine for e in snap.engines] == ["0", "1"]
    assert {engine for _, engine, _ in stats.utility_calls} == {"0", "1"}
    assert "2" not in stats.confirmed_resets and "2" not in stats.last_resets
    # Back again but silent: no last success from before it left.
    fleet.engines = ENGINES
    fleet.disconnected = {"2"}
    snap = await poller.poll_once()
    assert snap.engines[2].last_success_unix is None and not snap.engines[2].up


async def test_poll_soon_cuts_the_wait_short_and_a_failing_poll_does_not_stop_the_loop() -> None:
    raised = asyncio.Event()
    values = awake(ENGINES)

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if not raised.is_set():
            raised.set()
            raise RuntimeError("a bug in one poll")
        return values[engine][method]

    fleet = fleet_of(values)
    fleet.handler = handler
    poller = poller_over(fleet, interval_s=3600.0, jitter=0.0)
    task = asyncio.ensure_future(poller.run())
    try:
        await asyncio.wait_for(raised.wait(), 5)
        assert poller.snapshot.poll_number == 0  # the failed poll published nothing
        poller.poll_soon()  # an hour early
        snap = await poller.wait_for_poll(0, timeout_s=5)
        assert snap.poll_number == 1 and snap.ready
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_snapshot_no_poll_followed_is_republished_stale_then_a_poll_freshens_it(
    caplog: Any,
) -> None:
    wall = ManualClock(1000.0)
    poller = poller_over(fleet_of(awake(ENGINES)), wall_clock=wall, interval_s=5.0)
    assert poller.stale_after_s == 2 * (5.0 + 1.0) + 5.0
    assert not poller.mark_if_stale()  # no poll yet: nothing to mark
    seen: list[Any] = []
    poller.listeners.append(seen.append)
    first = await poller.poll_once()
    seen.clear()
    wall.now = 1000.0 + poller.stale_after_s
    assert not poller.mark_if_stale() and poller.snapshot is first  # within the bound
    wall.now += 1.5
    assert poller.mark_if_stale()
    marked = poller.snapshot
    assert marked.poll_number == 1 and {e.stale_s for e in marked.engines} == {18.0}
    assert poller.republished == 1 and seen == [marked]  # every surface told (the feeds)
    assert first.ready and not marked.ready  # the fleet's readiness fails closed too
    assert "no poll completed for 18 s" in caplog.text
    caplog.clear()
    assert not poller.mark_if_stale()  # the same second: nothing new
    wall.now += 1.0
    assert poller.mark_if_stale() and {e.stale_s for e in poller.snapshot.engines} == {19.0}
    assert caplog.text == ""  # warned once, when it turned stale
    poller.republish()  # a push meanwhile: still stale
    assert {e.stale_s for e in poller.snapshot.engines} == {19.0}
    fresh = await poller.poll_once()
    assert fresh.poll_number == 2 and {e.stale_s for e in fresh.engines} == {0.0}


async def test_the_freshness_watch_marks_a_poller_whose_poll_never_ends() -> None:
    wall = ManualClock(1000.0)
    poller = poller_over(fleet_of(awake(ENGINES)), wall_clock=wall, interval_s=0.05)
    await poller.poll_once()
    wall.now += poller.stale_after_s + 1.0
    watch = asyncio.ensure_future(poller.watch_freshness())
    try:
        for _ in range(100):
            if poller.republished:
                break
            await asyncio.sleep(0.02)
        assert {e.stale_s for e in poller.snapshot.engines} == {int(poller.stale_after_s) + 1.0}
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
