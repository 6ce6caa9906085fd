"""The pure parts of pushes, registration facts and the unsupported outcome: decoders, the
push book, info labels, verdicts, the gate's ``healthy`` and unsupported conditions, and the
sleep-mode capability check (no sockets: ``FakeFleet``)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.client.pushes import PushBook
from exporter.control.actions import NO_SLEEP_MODE, run_action
from exporter.control.gate import evaluate, parse_conditions
from exporter.control.parsing import parse_sleep
from exporter.control.verdicts import ActionVerdict, EngineVerdict
from exporter.error import ProtocolError
from exporter.metrics.families import info_labels
from exporter.protocol.handshake import (
    LEGACY_REGISTRATION_KEYS,
    decode_registration,
    encode_registration,
    registration_facts,
    registration_map,
)
from exporter.protocol.pushes import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    FT_UNKNOWN,
    MAX_FAULT_INFO,
    FaultStatus,
    RankStatus,
    decode_eep_notification,
    decode_ft_status,
    encode_ft_status_value,
    push_kind,
    read_rank_status,
)
from exporter.protocol.strings import is_cut
from tests.harness.gatesample import gate_sample

# -- decoders -------------------------------------------------------------------------------


def test_ft_status_payloads_as_vllm_builds_them() -> None:
    assert encode_ft_status_value(2, "unhealthy", "RuntimeError") == {
        "id": 2,
        "status": "unhealthy",
        "fault_info": "RuntimeError",
    }
    assert encode_ft_status_value(2, "dead") == {"id": 2, "status": "dead"}
    assert decode_ft_status({"id": 2, "status": "dead"}, 2) == RankStatus(2, "dead", None)
    cut = decode_ft_status(encode_ft_status_value(0, "unhealthy", "x" * 5000), 0).fault_info
    assert cut is not None and is_cut(cut) and len(cut.encode()) == MAX_FAULT_INFO


def test_the_one_rule_keeps_the_status_whatever_fault_info_is() -> None:
    """E1: pushes, the front end's table and HTTP answers read fault_info one way."""
    for info, shown in ((7, "7"), (["RuntimeError"], "['RuntimeError']"), (None, None)):
        value = {"id": 1, "status": "dead", "fault_info": info}
        assert read_rank_status(value, 1) == RankStatus(1, "dead", shown)
        assert decode_ft_status(value, 1) == RankStatus(1, "dead", shown)
    failed = {"id": 0, "status": "unhealthy", "fault_info": "boom", "ft_error": 3}
    assert read_rank_status(failed, 0).fault_info == "boom, recovery failed: 3"
    assert read_rank_status({"id": 0, "status": "dead", "fault_info": 10**5000}, 0).status == "dead"


@pytest.mark.parametrize(
    "value",
    [
        None,
        "ft",
        [0, "healthy"],
        {"id": True, "status": "healthy"},
        {"id": "0", "status": "healthy"},
        {"id": 0, "status": 0},
        {"id": 0, "status": {"name": "healthy"}},
        {"id": 0, "status": None},
        {"id": 0},
    ],
)
def test_an_unreadable_status_is_unknown_never_dropped(value: Any) -> None:
    """E1: fail closed: the engine's own push it cannot read makes its status unknown."""
    read = decode_ft_status(value, 0)
    assert (read.rank, read.status) == (0, FT_UNKNOWN)
    assert read.problem and read.fault_info and read.fault_info.startswith("unreadable status")


def test_a_status_naming_another_engine_is_refused() -> None:
    with pytest.raises(ProtocolError) as err:
        decode_ft_status({"id": 1, "status": "healthy"}, 0)
    assert err.value.kind == "bad_push"


def test_eep_notifications_and_push_kinds() -> None:
    assert decode_eep_notification(["RECONFIGURE_FINISHED", 3]) == ("RECONFIGURE_FINISHED", 3)
    assert decode_eep_notification(["SHUTDOWN_COMPLETE", 0]) == ("SHUTDOWN_COMPLETE", 0)
    bad_ones = (None, ["X"], ["X", "3"], [1, 2], ["X", 1, 2], ["E" * 10**6, 0], ["X", 0])
    for bad in (*bad_ones, ["SHUTDOWN_COMPLETE", -1]):  # E9: known events, possible ranks
        with pytest.raises(ProtocolError):
            decode_eep_notification(bad)
    assert push_kind(FT_STATUS_CALL_ID) == "fault_tolerance_status"
    assert push_kind(EEP_NOTIFICATION_CALL_ID) == "elastic_ep"
    assert push_kind(-7) == "other"


def test_the_push_book_keeps_since_until_the_status_changes() -> None:
    now = [100.0]
    faults = ProtocolErrorTally()
    book = PushBook(faults, clock=lambda: now[0])
    book.on_push("1", 1, FT_STATUS_CALL_ID, encode_ft_status_value(1, "unhealthy", "E"))
    now[0] = 105.0
    book.on_push("1", 1, FT_STATUS_CALL_ID, encode_ft_status_value(1, "unhealthy", "E"))
    assert book.fault_status["1"] == FaultStatus("unhealthy", "E", 100.0)
    assert book.fault_status["1"].faulty
    book.on_push("1", 1, FT_STATUS_CALL_ID, encode_ft_status_value(1, "healthy"))
    assert book.fault_status["1"] == FaultStatus("healthy", None, 105.0)
    book.on_push("1", 1, FT_STATUS_CALL_ID, {"id": 0, "status": "dead"})  # spoof: changes nothing
    assert book.fault_status["1"].status == "healthy" and faults.counts == {"bad_push": 1}
    book.on_push("1", 1, EEP_NOTIFICATION_CALL_ID, ["SHUTDOWN_COMPLETE", 1])
    assert book.membership["1"].event == "SHUTDOWN_COMPLETE"
    assert book.counts_of("1") == {"fault_tolerance_status": 4, "elastic_ep": 1}
    book.forget("1")
    assert "1" not in book.fault_status and "1" not in book.membership


@pytest.mark.parametrize(
    ("sent", "recorded", "info"),
    [
        ("paused", "paused", None),
        ("recovering", "recovering", None),
        ("zzz-new", "other", "status 'zzz-new'"),
        ("HEALTHY", "other", "status 'HEALTHY'"),  # only vLLM's exact name is healthy
        ("", "other", "status ''"),
    ],
)
def test_a_readable_status_beyond_0_33_is_recorded_and_not_counted(
    sent: str, recorded: str, info: str | None
) -> None:
    """vLLM PR #41438's statuses are their own values, any other string is ``other``: readable,
    so never a ``bad_push``; faulty all the same (only healthy is healthy)."""
    faults = ProtocolErrorTally()
    book = PushBook(faults)
    assert book.on_push("1", 1, FT_STATUS_CALL_ID, encode_ft_status_value(1, "healthy"))
    assert book.on_push("1", 1, FT_STATUS_CALL_ID, {"id": 1, "status": sent})
    kept = book.fault_status["1"]
    assert (kept.status, kept.fault_info, kept.faulty) == (recorded, info, True)
    assert faults.counts == {}
    book.on_push("1", 1, FT_STATUS_CALL_ID, {"id": 1, "status": 2})  # no string: unreadable
    assert book.fault_status["1"].status == FT_UNKNOWN and faults.counts == {"bad_push": 1}


# -- registration ---------------------------------------------------------------------------


def test_registration_facts_of_every_version() -> None:
    full = decode_registration(encode_registration(registration_map(3, vllm_version="0.33.0")))
    facts = dict(full.facts)
    assert facts["data_parallel_rank"] == 3 and facts["vllm_version"] == "0.33.0"
    assert facts["enable_sleep_mode"] is True and "kv_cache_size_tokens" not in facts  # None
    legacy = registration_map(0, keys=LEGACY_REGISTRATION_KEYS)
    assert set(legacy) == {"max_model_len", "num_gpu_blocks", "dp_stats_address"}
    old = decode_registration(encode_registration(legacy))
    assert dict(old.facts) == {"max_model_len": 4096, "num_gpu_blocks": 1000}
    assert old.vllm_version is None and old.enable_sleep_mode is None
    hostile = registration_facts(
        {"vllm_version": "v" * 10**6, "max_model_len": True, "world_size": 2**70, "dtype": 5}
    )
    assert hostile == (("vllm_version", "v" * 64),)


def test_info_labels_say_unknown_for_what_an_engine_did_not_send() -> None:
    old = EngineDetail("0", True, "a", registration=(("max_model_len", 4096),))
    assert info_labels(old) == ("unknown",) * 8
    new = decode_registration(encode_registration(registration_map(1, enable_sleep_mode=False)))
    detail = EngineDetail("1", True, "a", vllm_version="0.33.0", registration=new.facts)
    no_front_end = ("unknown", "unknown")  # owner mode: no API server in the way
    assert info_labels(detail) == ("0.33.0", *no_front_end, "false", "1", "1", "1", "bfloat16")
    rust = EngineDetail("2", True, "a", "0.33.0", front_end="rust", rust_frontend_version="0.33.0")
    assert info_labels(rust)[:3] == ("0.33.0", "rust", "0.33.0")


# -- verdicts -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reasons", "outcome", "status"),
    [
        (("unsupported",), "unsupported", 501),
        (("unsupported", "unsupported"), "unsupported", 501),
        (("unsupported", None), "partial_failure", 502),
        (("unsupported", "timeout"), "failure", 502),
        ((None,), "success", 200),
    ],
)
def test_unsupported_is_its_own_outcome(
    reasons: tuple[str | None, ...], outcome: str, status: int
) -> None:
    v = ActionVerdict("x", tuple(EngineVerdict(str(i), r) for i, r in enumerate(reasons)), False)
    assert (v.outcome, v.status) == (outcome, status)


async def test_sleep_is_not_sent_to_engines_registered_without_sleep_mode() -> None:
    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        return True if method == "is_sleeping" else None

    request = parse_sleep({}, b"")
    nowhere = FakeFleet(handler, engines=("0", "1"), sleep_mode={"0": False, "1": False})
    result = await run_action(nowhere, request, timeout_s=1.0)
    assert result.status == 501 and result.body["outcome"] == "unsupported"
    assert nowhere.calls == []
    assert {e["error"] for e in result.body["engines"]} == {NO_SLEEP_MODE}
    mixed = FakeFleet(handler, engines=("0", "1", "2"), sleep_mode={"1": False, "2": None})
    result = await run_action(mixed, request, timeout_s=1.0)
    assert result.status == 502 and result.body["failed_engines"] == [1]
    # Unknown (None) is asked as before; the engine without sleep mode is neither called nor
    # read back.
    assert sorted({e for e, _, _ in mixed.calls}) == ["0", "2"]


# -- the gate -------------------------------------------------------------------------------


MISSING = "Call to get_weight_version method failed: 'EngineCoreProc' object has no attribute"


def test_the_gates_healthy_condition() -> None:
    assert parse_conditions({"healthy": ["true"]}) == {"healthy": True}
    awake = {"is_sleeping": False}
    sick = {
        "1": FaultStatus("unhealthy", "RuntimeError", 1.0),
        "0": FaultStatus("healthy", None, 1.0),
    }
    status, body = evaluate(
        {"healthy": True}, gate_sample({"0": awake, "1": awake, "2": awake}, sick), 0
    )
    assert status == 412 and body["failing_engines"] == ["1"]
    assert "unhealthy (RuntimeError)" in body["engines"][1]["failures"][0]
    status, _ = evaluate({"healthy": True}, gate_sample({"0": awake, "2": awake}, sick), 0)
    assert status == 200  # engine 2 never reported: healthy as far as anyone knows
    status, body = evaluate({"healthy": True}, gate_sample({"0": awake}, None), 0)
    assert status == 501 and body["unsupported"] == ["healthy"]  # relay mode cannot know


def test_a_condition_no_engine_supports_is_501_and_a_mix_is_412() -> None:
    engines = {
        e: {
            "is_sleeping": False,
            "get_weight_version": EngineOutcome(e, Outcome.FAILED, error=MISSING),
        }
        for e in ("0", "1")
    }
    status, body = evaluate({"weight_version": "v1"}, gate_sample(engines, {}), 0)
    assert status == 501 and body["unsupported"] == ["weight_version"] and not body["ok"]
    engines["1"]["get_weight_version"] = "v1"
    status, body = evaluate({"weight_version": "v1"}, gate_sample(engines, {}), 0)
    assert status == 412 and body["failing_engines"] == ["0"]
    status, _ = evaluate({}, gate_sample(engines, {}), 0)
    assert status == 200  # not asked about: an unsupported method fails nothing


def test_status_changes_are_logged_at_most_once_per_engine_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    book = PushBook(ProtocolErrorTally(), clock=lambda: now[0])
    caplog.set_level("INFO", logger="exporter.client")
    for i in range(1000):  # a flapping (or hostile) engine
        status = "unhealthy" if i % 2 else "healthy"
        assert book.on_push("0", 0, FT_STATUS_CALL_ID, encode_ft_status_value(0, status, "E"))
    assert len(caplog.records) == 1
    now[0] = 11.0
    book.on_push("0", 0, FT_STATUS_CALL_ID, encode_ft_status_value(0, "unhealthy", "F"))
    assert len(caplog.records) == 2 and "999 more since the last line" in caplog.messages[1]
    assert book.counts_of("0") == {"fault_tolerance_status": 1001}
    assert not book.on_push("0", 0, FT_STATUS_CALL_ID, encode_ft_status_value(0, "unhealthy", "F"))
