"""``exporter/protocol/pushes.py``: what engines send with vLLM's reserved negative call ids
(pure). Payloads as vLLM builds them, unreadable statuses, spoofed ranks and elastic-EP shapes
are in tests/unit/protocol/test_pushes_and_unsupported.py; here: which rank an entry names, which
statuses count as faulty, and the bounds of what is kept."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.error import ProtocolError
from exporter.protocol.pushes import (
    FT_FAULTY,
    FT_OTHER,
    FT_STATE_VALUES,
    FT_STATUSES,
    FT_UNKNOWN,
    MASK_SHOWN,
    MAX_FAULT_INFO,
    MAX_MASK,
    MAX_OTHER_STATUS,
    FaultStatus,
    decode_eep_notification,
    decode_ft_status,
    encode_ft_status_value,
    entry_rank,
    read_rank_status,
)
from exporter.protocol.strings import CUT_MARKER


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


def test_a_status_that_is_no_string_is_named_briefly_in_the_problem() -> None:
    read = read_rank_status({"status": ["s" * 10_000]}, 0)
    assert read.status == FT_UNKNOWN and read.problem is not None
    assert read.problem == "fault-tolerance status is not text but list"
    missing = read_rank_status({}, 0)
    assert missing.problem == "fault-tolerance status is not text but NoneType"
    assert missing.fault_info == f"unreadable status: {missing.problem}"
    assert read_rank_status({"status": 2}, 0).status == FT_UNKNOWN  # PR #41438's codes: no name


@pytest.mark.parametrize(
    "status", ["healthy", "unhealthy", "dead", "paused", "recovering", "diagnosing"]
)
def test_every_status_vllm_names_is_its_own_value(status: str) -> None:
    read = read_rank_status({"id": 3, "status": status, "fault_info": "f"}, 3)
    assert (read.status, read.fault_info, read.problem) == (status, "f", None)


@pytest.mark.parametrize(
    ("mask", "shown"),
    [
        ([0, 1], "E; all2all mask 01"),
        ([], "E; all2all mask "),
        ([1] * (MASK_SHOWN + 1), "E; all2all mask " + "1" * MASK_SHOWN + "... (65 ranks)"),
        ([0, 2], "E; all2all mask [0, 2]"),  # an int32 tensor's values, not only bits
        ([1 << 31], "E; mask unreadable"),
        ([True], "E; mask unreadable"),
        ("0110", "E; mask unreadable"),
        ([0] * (MAX_MASK + 1), "E; mask unreadable"),
    ],
)
def test_vllm_0_34_s_mask_is_shown_bounded(mask: Any, shown: str) -> None:
    read = read_rank_status({"status": "unhealthy", "fault_info": "E", "mask": mask}, 1)
    assert (read.status, read.fault_info) == ("unhealthy", shown)


@pytest.mark.parametrize(
    ("ft_state", "shown"),
    [
        ("recovering", "unhealthy; front end: recovering"),
        ("failed", "unhealthy; front end: failed"),
        ("x" * 500, "unhealthy; front end: 'xxxxxxxx"),  # cut (MAX_OTHER_STATUS)
        (7, "unhealthy; front end: int"),
    ],
)
def test_the_front_end_s_recovery_state_is_shown(ft_state: Any, shown: str) -> None:
    read = read_rank_status({"status": "unhealthy", "ft_state": ft_state}, 0)
    assert read.status == "unhealthy" and read.fault_info is not None
    assert read.fault_info.startswith(shown), read.fault_info
    assert len(read.fault_info.encode()) <= MAX_FAULT_INFO


def test_any_other_status_string_is_other_named_in_fault_info() -> None:
    read = read_rank_status({"status": "zzz-new", "fault_info": "E"}, 0)
    assert (read.status, read.fault_info, read.problem) == (FT_OTHER, "status 'zzz-new': E", None)
    failed = read_rank_status({"status": "draining", "ft_error": "boom"}, 0)
    assert failed.fault_info == "status 'draining', recovery failed: boom"


def test_a_hostile_status_string_is_cut_escaped_and_never_a_value() -> None:
    """10 KB of text with control characters and a lone surrogate: ``other``, shown in
    ``fault_info`` cut to a few dozen bytes, every control character escaped."""
    hostile = ("\x00\x1b[31m\r\n\ud800" + "s" * 20) * 400
    assert len(hostile) > 10_000
    read = read_rank_status({"status": hostile, "fault_info": "x" * 10_000}, 0)
    assert read.status == FT_OTHER and read.problem is None
    info = read.fault_info
    assert info is not None and info.startswith("status '\\x00\\x1b[31m\\r\\n")
    assert len(info.encode()) <= MAX_FAULT_INFO
    assert all(c.isprintable() for c in info)
    named = info.split("': ", 1)[0]
    assert CUT_MARKER in named and len(named.encode()) <= 2 * MAX_OTHER_STATUS + len("status ")
    other = read_rank_status({"status": hostile[:-1]}, 0).fault_info
    assert other is not None and other != info  # the marker's digest tells them apart


def test_new_statuses_are_sent_as_given() -> None:
    assert encode_ft_status_value(1, "paused") == {"id": 1, "status": "paused"}
    assert encode_ft_status_value(1, "recovering", "retry") == {
        "id": 1,
        "status": "recovering",
        "fault_info": "retry",
    }
    assert encode_ft_status_value(1, "dead", "x") == {"id": 1, "status": "dead"}  # as vLLM 0.33
    assert set(FT_STATE_VALUES) == {*FT_STATUSES, FT_OTHER, FT_UNKNOWN}
    assert set(FT_STATE_VALUES) - {"healthy"} == FT_FAULTY


def test_an_elastic_ep_rank_must_be_an_integer_not_a_boolean() -> None:
    with pytest.raises(ProtocolError):
        decode_eep_notification(["SHUTDOWN_COMPLETE", False])
    assert decode_eep_notification(["RECONFIGURE_FINISHED", 0]) == ("RECONFIGURE_FINISHED", 0)


def test_fault_info_is_sent_only_while_unhealthy() -> None:
    assert encode_ft_status_value(3, "unhealthy") == {
        "id": 3,
        "status": "unhealthy",
        "fault_info": None,
    }
    assert encode_ft_status_value(3, "healthy", "ignored") == {"id": 3, "status": "healthy"}
