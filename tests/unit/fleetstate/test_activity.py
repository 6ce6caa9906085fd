"""``exporter/fleetstate/activity.py``: ``--hung-after`` in effect and the routable verdict with
its reasons (pure; the poller's hung detection over real sockets is in
tests/integration/conformance/test_activity_conformance.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.activity import (
    STALE_MARGIN_S,
    hung_after_s,
    is_stalled,
    marked_stale,
    routability,
    stale_after_s,
)
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot
from exporter.protocol.progress import RankProgress
from exporter.protocol.pushes import FaultStatus
from tests.harness.snapshots import engine_snapshot


def test_hung_after_is_the_setting_or_three_polls_never_below_the_call_timeout() -> None:
    assert hung_after_s(7.0, 5.0, 10.0) == 7.0
    assert hung_after_s(0.0, 5.0, 10.0) == 15.0
    assert hung_after_s(0.0, 1.0, 10.0) == 10.0


def test_an_awake_answering_rank_is_routable_with_no_reasons() -> None:
    verdict = routability(engine_snapshot("0", is_sleeping=False, is_scheduler_paused=False))
    assert verdict.routable and verdict.reasons == ()


def test_each_reason_a_rank_should_not_take_traffic() -> None:
    timeout = EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s")
    silent = routability(engine_snapshot("0", is_sleeping=timeout))
    assert not silent.routable and silent.reasons == ("no answer in the last poll (timeout)",)
    asleep = engine_snapshot("0", is_sleeping=True, is_scheduler_paused=False)
    assert routability(asleep).reasons == ("asleep",)
    paused = engine_snapshot("0", is_sleeping=True, is_scheduler_paused=True)
    assert routability(paused).reasons == ("paused",)
    hung = dataclasses.replace(
        engine_snapshot("0", is_sleeping=timeout), hung=True, unresponsive_s=42.4
    )
    assert routability(hung).reasons[0] == "hung: no answer for 42 s"
    disagree = EngineOutcome("rs", Outcome.INCONSISTENT, values=(False, True), error="...")
    split = routability(engine_snapshot("rs", is_sleeping=disagree))
    assert not split.routable and split.reasons == ("its ranks disagree (inconsistent)",)
    gone = engine_snapshot("0", EngineDetail("0", False, "x"), is_sleeping=timeout)
    assert routability(gone).reasons[0] == "disconnected"


def test_a_fault_tolerance_status_that_is_not_healthy_is_a_reason() -> None:
    for status, why in (("unhealthy", "E"), ("dead", None), ("unknown", "unreadable status: x")):
        ft = FaultStatus(status, why, 1.0)
        detail = EngineDetail("0", True, "x", fault_status=ft)
        verdict = routability(
            engine_snapshot("0", detail, is_sleeping=False, is_scheduler_paused=False)
        )
        info = f" ({why})" if why else ""
        assert verdict.reasons == (f"fault tolerance: {status}{info}",), verdict
    healthy = EngineDetail("0", True, "x", fault_status=FaultStatus("healthy", None, 1.0))
    assert routability(
        engine_snapshot("0", healthy, is_sleeping=False, is_scheduler_paused=False)
    ).routable


STALL_S = 60.0
#: A rank that computed 500 tokens, the last at 1000.0 (unix), holding 2 requests of its own.
QUIET = RankProgress(500, 1000.0, "stat_logger", held=2)


def holding(has_work: object = True, **answers: object) -> EngineSnapshot:
    """An awake rank that answered, and said ``has_work``."""
    said: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False}
    return engine_snapshot("1", **{**said, "has_work": has_work, **answers})


def test_a_rank_holding_requests_that_computed_nothing_for_stall_after_is_stalled() -> None:
    assert is_stalled(holding(), QUIET, 1000.0 + STALL_S, STALL_S)
    assert not is_stalled(holding(), QUIET, 1000.0 + STALL_S - 0.1, STALL_S)  # not yet


def test_the_stall_clock_starts_when_the_rank_got_its_work() -> None:
    """Idle since 1000.0, a request held from 4600.0: no token for --stall-after after that."""
    woken = RankProgress(500, 1000.0, "stat_logger", held=1, held_since_unix=4600.0)
    assert not is_stalled(holding(), woken, 4600.0 + STALL_S - 0.1, STALL_S)  # its prefill
    assert is_stalled(holding(), woken, 4600.0 + STALL_S, STALL_S)
    # A token after the work came: the clock runs from the token.
    stepped = RankProgress(510, 4650.0, "stat_logger", held=1, held_since_unix=4600.0)
    assert not is_stalled(holding(), stepped, 4600.0 + STALL_S + 1, STALL_S)
    assert is_stalled(holding(), stepped, 4650.0 + STALL_S, STALL_S)


def test_every_condition_of_stalled_is_needed() -> None:
    late = 1000.0 + 10 * STALL_S
    assert not is_stalled(holding(), QUIET, late, 0.0)  # --stall-after 0: never
    assert not is_stalled(holding(), None, late, STALL_S)  # no source
    http = RankProgress(500, 1000.0, "metrics", held=2)
    assert not is_stalled(holding(), http, late, STALL_S)  # /metrics: a gauge can be stale
    for held in (0, None):  # holds none of the requests its source counts, or unknown
        assert not is_stalled(holding(), RankProgress(500, 1000.0, "stat_logger", held), late, 60)
    assert not is_stalled(holding(False), QUIET, late, STALL_S)  # vLLM says no work
    failed = EngineOutcome("1", Outcome.FAILED, error="unreadable")
    assert not is_stalled(holding(failed), QUIET, late, STALL_S)  # unknown work
    paused = holding(is_sleeping=True, is_scheduler_paused=True)
    assert not is_stalled(paused, QUIET, late, STALL_S)  # the operator's pause wins
    asleep = holding(is_sleeping=True)
    assert not is_stalled(asleep, QUIET, late, STALL_S)
    hung = dataclasses.replace(holding(), hung=True, unresponsive_s=99.0)
    assert not is_stalled(hung, QUIET, late, STALL_S)  # no answers: hung, not stalled


def test_a_stalled_rank_reads_stalled_and_is_not_routable() -> None:
    stalled = dataclasses.replace(holding(), progress=QUIET, progress_age_s=75.2, stalled=True)
    assert stalled.state == "stalled"
    verdict = routability(stalled)
    assert not verdict.routable
    assert verdict.reasons == ("stalled: holds requests, no token computed for 75 s",)
    paused = dataclasses.replace(holding(is_sleeping=True, is_scheduler_paused=True), stalled=True)
    assert paused.state == "paused"  # never both: the poller marks only an awake rank


def test_the_stale_bound_is_what_a_running_poller_takes_with_a_margin() -> None:
    # Twice (interval + call timeout): the wait, the spread, a timeout, a confirming read.
    assert stale_after_s(5.0, 10.0) == 30.0 + STALE_MARGIN_S
    assert stale_after_s(1.0, 10.0) == 22.0 + STALE_MARGIN_S


def snapshot_at(taken_at_unix: float) -> FleetSnapshot:
    engines = tuple(
        engine_snapshot(e, is_sleeping=False, is_scheduler_paused=False) for e in ("0", "1", "2")
    )
    return FleetSnapshot(taken_at_unix, 0.01, engines, {}, 3, 3, poll_number=7)


def test_a_snapshot_older_than_the_bound_is_marked_stale_once_per_whole_second() -> None:
    snap = snapshot_at(1000.0)
    assert marked_stale(snap, 1030.0, 30.0) is None  # at the bound: still fresh
    marked = marked_stale(snap, 1031.4, 30.0)
    assert marked is not None and [e.stale_s for e in marked.engines] == [31.0] * 3
    assert (marked.poll_number, marked.taken_at_unix) == (7, 1000.0)  # the same poll's
    assert marked_stale(marked, 1031.9, 30.0) is None  # the same second: nothing new
    later = marked_stale(marked, 1032.0, 30.0)
    assert later is not None and {e.stale_s for e in later.engines} == {32.0}
    assert marked_stale(snapshot_at(0.0), 5000.0, 30.0) is None  # no poll yet: nothing to age


def test_a_stale_rank_is_not_routable_and_says_so_first_whatever_it_answered() -> None:
    (awake, *_) = snapshot_at(1000.0).engines
    assert routability(awake).routable
    stale = dataclasses.replace(awake, stale_s=31.0)
    verdict = routability(stale)
    assert not verdict.routable and verdict.reasons == ("stale: no poll for 31 s",)
    assert stale.state == "awake"  # the state stays as last read; only routing fails closed
    hung = dataclasses.replace(stale, hung=True, unresponsive_s=40.0)
    assert routability(hung).reasons[:2] == ("stale: no poll for 31 s", "hung: no answer for 40 s")
