"""``ProtocolErrorTally``: every rejection counted, one log line per kind per interval (with the
number suppressed since), the generation bumped on every change. A moved clock, no waiting."""

from __future__ import annotations

import logging

import pytest

from exporter.base.faults import ProtocolErrorTally
from tests.harness.clock import ManualClock


def tally() -> tuple[ProtocolErrorTally, ManualClock]:
    clock = ManualClock()
    return ProtocolErrorTally(log_interval_s=60.0, clock=clock), clock


def messages(caplog: pytest.LogCaptureFixture, logger: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_records_are_all_counted_but_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    faults, clock = tally()
    caplog.set_level(logging.WARNING, "exporter.protocol_errors")
    for i in range(5):
        faults.record("bad_frame", f"frame {i}")
    assert faults.counts == {"bad_frame": 5}
    assert messages(caplog, "exporter.protocol_errors") == ["protocol error bad_frame: frame 0"]
    clock.now += 59.9
    faults.record("bad_frame", "frame 5")
    assert len(messages(caplog, "exporter.protocol_errors")) == 1, "still within the interval"
    clock.now += 0.1
    faults.record("bad_frame", "frame 6")
    assert messages(caplog, "exporter.protocol_errors")[-1] == (
        "protocol error bad_frame: frame 6 (5 more since last report)"
    )
    assert faults.counts == {"bad_frame": 7}


def test_each_kind_has_its_own_interval(caplog: pytest.LogCaptureFixture) -> None:
    faults, _ = tally()
    caplog.set_level(logging.WARNING, "exporter.protocol_errors")
    faults.record("a", "one")
    faults.record("b", "two")
    faults.record("a", "three")
    assert messages(caplog, "exporter.protocol_errors") == [
        "protocol error a: one",
        "protocol error b: two",
    ]
    assert faults.counts == {"a": 2, "b": 1}


def test_every_change_bumps_the_generation() -> None:
    """The render cache's key: a scrape never serves a body older than these counters."""
    faults, _ = tally()
    assert faults.generation == 0
    faults.record("a", "x")
    sink = faults.http_listener("metrics")
    sink("bad request line")
    faults.task_failed("poller", RuntimeError("boom"))
    assert faults.generation == 4


def test_a_listeners_series_starts_at_zero_and_counts_its_bad_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    faults, clock = tally()
    caplog.set_level(logging.WARNING, "exporter.http")
    admin = faults.http_listener("admin")
    faults.http_listener("metrics")
    assert faults.http_bad_requests == {"admin": 0, "metrics": 0}
    admin("Invalid method")
    admin("Invalid method")
    faults.bad_http_request("metrics", "Bad status line")
    assert faults.http_bad_requests == {"admin": 2, "metrics": 1}
    assert messages(caplog, "exporter.http") == [
        "malformed HTTP request on the admin listener: Invalid method",
        "malformed HTTP request on the metrics listener: Bad status line",
    ]
    clock.now += 60
    admin("Header too long")
    assert messages(caplog, "exporter.http")[-1].endswith("(1 more since last report)")
    assert faults.counts == {}, "malformed requests are not protocol errors"


def test_a_failed_task_is_counted_and_its_traceback_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    faults, clock = tally()
    caplog.set_level(logging.ERROR, "exporter.protocol_errors")
    for _ in range(3):
        faults.task_failed("poller", ValueError("boom"))
    faults.task_failed("handshake", KeyError("k"))
    assert faults.task_failures == {"poller": 3, "handshake": 1}
    logged = [r for r in caplog.records if r.name == "exporter.protocol_errors"]
    assert [r.getMessage() for r in logged] == [
        "background task poller failed",
        "background task handshake failed",
    ]
    assert logged[0].exc_info is not None and isinstance(logged[0].exc_info[1], ValueError)
    clock.now += 60
    faults.task_failed("poller", ValueError("again"))
    assert len([r for r in caplog.records if r.name == "exporter.protocol_errors"]) == 3
