"""``PushBook`` on its own (no sockets): what each engine said unasked, kept per engine by one
rule whatever the attach mode, and what is counted when it cannot be read."""

from __future__ import annotations

import logging

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.pushes import BAD_FT_STATUS, FT_UNKNOWN, PUSH_BAD, PushBook
from exporter.protocol.pushes import (
    FT_STATUS_CALL_ID,
    encode_ft_status_value,
    read_rank_status,
)


def book_at(now: list[float]) -> tuple[PushBook, ProtocolErrorTally]:
    faults = ProtocolErrorTally()
    return PushBook(faults, clock=lambda: now[0]), faults


def test_a_status_keeps_its_since_until_it_changes() -> None:
    now = [100.0]
    book, _ = book_at(now)
    assert book.set_fault_status("0", "unhealthy", "NCCL timeout") is True
    now[0] = 200.0
    assert book.set_fault_status("0", "unhealthy", "NCCL timeout") is False
    assert book.fault_status["0"].since_unix == 100.0
    assert book.set_fault_status("0", "healthy", None) is True
    assert (book.fault_status["0"].status, book.fault_status["0"].since_unix) == ("healthy", 200.0)


def test_a_push_is_counted_by_kind_and_recorded_on_its_engine() -> None:
    book, faults = book_at([1.0])
    value = encode_ft_status_value(2, "unhealthy", "lost")
    assert book.on_push("2", 2, FT_STATUS_CALL_ID, value) is True
    assert book.fault_status["2"].status == "unhealthy"
    assert book.counts_of("2") and sum(book.counts_of("2").values()) == 1
    assert book.counts_of("1") == {}
    assert faults.counts.get(PUSH_BAD, 0) == 0


def test_an_unreadable_status_is_unknown_and_counted_never_dropped() -> None:
    book, faults = book_at([1.0])
    book.set_fault_status("0", "healthy", None)
    assert book.on_push("0", 0, FT_STATUS_CALL_ID, {"status": 7}) is True
    assert book.fault_status["0"].status == FT_UNKNOWN
    assert faults.counts[PUSH_BAD] == 1


def test_a_front_end_status_is_counted_under_its_own_kind() -> None:
    book, faults = book_at([1.0])
    book.record("a/1", read_rank_status({"status": None}, 1), BAD_FT_STATUS)
    assert book.fault_status["a/1"].status == FT_UNKNOWN
    assert faults.counts[BAD_FT_STATUS] == 1 and PUSH_BAD not in faults.counts


def test_set_unknown_says_why_and_reports_a_change_once() -> None:
    book, _ = book_at([1.0])
    assert book.set_unknown("0", "not read: TimeoutError") is True
    assert book.set_unknown("0", "not read: TimeoutError") is False
    assert book.fault_status["0"].fault_info == "not read: TimeoutError"


def test_forget_starts_the_engine_over_and_drop_forgets_its_counts() -> None:
    book, _ = book_at([1.0])
    book.on_push("1", 1, FT_STATUS_CALL_ID, encode_ft_status_value(1, "unhealthy"))
    book.forget("1")
    assert "1" not in book.fault_status and book.counts_of("1")
    book.drop("1")
    assert book.counts_of("1") == {}


def test_a_flood_logs_at_most_one_line_per_engine_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [1.0]
    book, _ = book_at(now)
    with caplog.at_level(logging.INFO, logger="exporter.client"):
        for i in range(50):
            book.set_fault_status("0", "unhealthy" if i % 2 else "healthy", None)
        now[0] += 60.0
        book.set_fault_status("0", "unhealthy", "again")
    lines = [r.getMessage() for r in caplog.records if r.name == "exporter.client"]
    assert len(lines) == 2, lines
    assert "more since the last line" in lines[1]
