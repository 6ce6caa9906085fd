"""``exporter/protocol/pushes.py``: what engines send with vLLM's reserved negative call ids
(pure). Payloads as vLLM builds them, unreadable statuses, spoofed ranks and elastic-EP shapes
are in tests/unit/protocol/test_pushes_and_unsupported.py; here: which rank an entry names, which
statuses count as faulty, and the bounds of what is kept."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.error import ProtocolError
from exporter.protocol.pushes import (
    FT_STATE_VALUES,
    FT_UNKNOWN,
    FaultStatus,
    decode_eep_notification,
    decode_ft_status,
    encode_ft_status_value,
    entry_rank,
    read_rank_status,
)


@pytest.mark.parametrize(
    ("value", "rank"),
    [
        ({"id": 0}, 0),
        ({"id": 65535}, 65535),
        ({"id": 65536}, None),
        ({"id": -1}, None),
        ({"id": True}, None),
        ({"id": 1.0}, None),
        ({}, None),
        ([0], None),
    ],
)
def test_the_rank_an_entry_names(value: Any, rank: int | None) -> None:
    assert entry_rank(value) == rank


def test_a_push_naming_no_readable_engine_is_the_senders_own_unknown_status() -> None:
    status = decode_ft_status({"id": "zero", "status": "healthy"}, 4)
    assert (status.rank, status.status) == (4, FT_UNKNOWN)
    assert status.problem == "names engine 'zero'"


@pytest.mark.parametrize(("status", "faulty"), [(s, s != "healthy") for s in FT_STATE_VALUES])
def test_every_status_but_healthy_is_faulty(status: str, faulty: bool) -> None:
    assert FaultStatus(status, None, 0.0).faulty is faulty


def test_a_failed_recovery_is_shown_even_without_fault_info() -> None:
    read = read_rank_status({"status": "unhealthy", "ft_error": "x" * 1000}, 1)
    assert read.fault_info is not None
    assert read.fault_info.startswith("unhealthy, recovery failed: xxx")
    assert len(read.fault_info.encode()) <= 256
    assert read_rank_status({"status": "dead", "ft_error": ""}, 1).fault_info is None


def test_an_unknown_status_is_named_briefly_in_the_problem() -> None:
    read = read_rank_status({"status": "s" * 10_000}, 0)
    assert read.status == FT_UNKNOWN and read.problem is not None
    assert read.problem.startswith("unknown fault-tolerance status 'sss")
    assert len(read.problem) < 80
    assert (
        read_rank_status({"status": None}, 0).problem == "unknown fault-tolerance status NoneType"
    )


def test_an_elastic_ep_rank_must_be_an_integer_not_a_boolean() -> None:
    with pytest.raises(ProtocolError):
        decode_eep_notification(["SHUTDOWN_COMPLETE", False], 0)
    assert decode_eep_notification(["RECONFIGURE_FINISHED", 0], 0) == ("RECONFIGURE_FINISHED", 0)


def test_fault_info_is_sent_only_while_unhealthy() -> None:
    assert encode_ft_status_value(3, "unhealthy") == {
        "id": 3,
        "status": "unhealthy",
        "fault_info": None,
    }
    assert encode_ft_status_value(3, "healthy", "ignored") == {"id": 3, "status": "healthy"}
