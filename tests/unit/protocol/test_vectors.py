"""Every wire vector of the spec reproduced byte for byte (timestamps fixed), and decoded back."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    decode_engine_outputs,
    decode_handshake_message,
    decode_init,
    decode_registration,
    decode_utility_request,
    encode_handshake_message,
    encode_init,
    encode_registration,
    encode_utility_reply,
    encode_utility_request,
    engine_identity,
    identity_engine_index,
    registration_map,
)
from exporter.protocol.utility import custom_notification, encode_notifications_output

TS = 12345.5

REQUESTS = {
    "utility_is_sleeping": (0, 7, "is_sleeping", ()),
    "utility_reset_prefix_cache_ff": (0, 7, "reset_prefix_cache", (False, False)),
    "utility_reset_prefix_cache_noargs": (0, 8, "reset_prefix_cache", ()),
    "utility_sleep_1_abort": (0, 9, "sleep", (1, "abort")),
    "utility_wake_up_none": (0, 10, "wake_up", (None,)),
    "utility_wake_up_tags": (0, 11, "wake_up", (["weights"],)),
    "utility_reset_prefix_cache_bigid": (
        0,
        0x0123456789ABCDEF,
        "reset_prefix_cache",
        (False, False),
    ),
}


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_requests_reproduce_vectors(vectors: dict[str, bytes], name: str) -> None:
    client_index, call_id, method, args = REQUESTS[name]
    assert encode_utility_request(client_index, call_id, method, args) == vectors[name]
    decoded = decode_utility_request(vectors[name])
    assert (decoded.client_index, decoded.call_id, decoded.method) == (
        client_index,
        call_id,
        method,
    )
    assert list(decoded.args) == list(args)


REPLIES: dict[str, dict[str, Any]] = {
    "eco_utility_true_e1": dict(engine_index=1, call_id=7, value=True),
    "eco_utility_true_e0": dict(engine_index=0, call_id=7, value=True),
    "eco_utility_none_e1": dict(engine_index=1, call_id=9, value=None),
    "eco_utility_failure_e1": dict(
        engine_index=1, call_id=7, failure_message="Call to is_sleeping method failed: boom"
    ),
    "eco_utility_shutdown_e1": dict(
        engine_index=1, call_id=7, failure_message="Server shutting down"
    ),
    "eco_insecure_true": dict(
        engine_index=1, call_id=7, value=True, type_info=["builtins", "bool"]
    ),
    "eco_insecure_none": dict(engine_index=1, call_id=7, value=None),
    "eco_insecure_str_v0": dict(
        engine_index=1, call_id=7, value="v0", type_info=["builtins", "str"]
    ),
    "eco_insecure_list_bools": dict(
        engine_index=1,
        call_id=7,
        value=[True, False],
        type_info=[["builtins", "bool"], ["builtins", "bool"]],
    ),
}


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_replies_reproduce_vectors(vectors: dict[str, bytes], name: str) -> None:
    spec = dict(REPLIES[name])
    engine_index = spec.pop("engine_index")
    call_id = spec.pop("call_id")
    assert encode_utility_reply(engine_index, call_id, timestamp=TS, **spec) == vectors[name]
    out = decode_engine_outputs(vectors[name])
    assert out.engine_index == engine_index
    assert out.utility is not None and out.utility.call_id == call_id
    assert out.utility.failure_message == spec.get("failure_message")
    assert out.utility.value == spec.get("value")  # type_info ignored


#: vLLM PR #51433 (not in 0.33): ``EngineCoreOutputs.engine_notifications``, position 9, as an
#: engine with it sends every output (nil when it has nothing to say).
NOTIFICATION = custom_notification("my_loader", {"rank": 1, "gbps": 12.5})
NOTIFICATIONS: dict[str, Any] = {
    "eco_utility_true_e1_notifications_nil": None,
    "eco_utility_true_e1_notifications_empty": [],
    "eco_utility_true_e1_notifications_custom": [NOTIFICATION],
}


class _PrCustomNotification(msgspec.Struct, tag="custom", omit_defaults=True):
    """PR #51433's ``vllm/v1/notifications.py::CustomNotification``, field for field."""

    key: str
    payload: dict[str, Any] = {}


class _PrEngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """vLLM 0.33's ``EngineCoreOutputs`` with PR #51433's appended field."""

    engine_index: int = 0
    outputs: list[Any] = []
    scheduler_stats: Any = None
    timestamp: float = 0.0
    utility_output: Any = None
    finished_requests: Any = None
    wave_complete: Any = None
    start_wave: Any = None
    weight_version: Any = None
    engine_notifications: list[_PrCustomNotification] | None = None


@pytest.mark.parametrize("name", sorted(NOTIFICATIONS))
def test_replies_with_the_trailing_engine_notifications_field(
    vectors: dict[str, bytes], name: str
) -> None:
    """10 positions decode as the 9 of vLLM 0.33 do: the trailing field is skipped unread."""
    notifications = NOTIFICATIONS[name]
    frame = encode_utility_reply(1, 7, value=True, timestamp=TS, engine_notifications=notifications)
    assert frame == vectors[name]
    assert frame[0] == 0x9A and frame[1:-1].startswith(vectors["eco_utility_true_e1"][1:])
    assert decode_engine_outputs(frame) == decode_engine_outputs(vectors["eco_utility_true_e1"])
    assert not decode_engine_outputs(frame).notice
    # What an engine with the PR encodes (its struct, its tagged, map-encoded notification).
    pr = msgspec.msgpack.decode(frame, type=_PrEngineCoreOutputs)
    assert msgspec.msgpack.encode(pr) == frame
    assert msgspec.to_builtins(pr.engine_notifications) == notifications
    assert pr.utility_output == [7, None, [None, True]]


def test_an_output_with_only_engine_notifications_is_a_notice(vectors: dict[str, bytes]) -> None:
    """No reply, and nothing the exporter counts as an error (``EngineOutput.notice``)."""
    frame = vectors["eco_notifications_only_e1"]
    pr = _PrEngineCoreOutputs(
        engine_index=1,
        timestamp=TS,
        engine_notifications=[_PrCustomNotification("my_loader", {"rank": 1, "gbps": 12.5})],
    )
    assert msgspec.msgpack.encode(pr) == frame
    assert encode_notifications_output(1, [NOTIFICATION], timestamp=TS) == frame
    out = decode_engine_outputs(frame)
    assert (out.engine_index, out.utility, out.notice) == (1, None, True)


def test_a_custom_notification_leaves_out_an_empty_payload() -> None:
    """As the PR's ``omit_defaults`` struct encodes it."""
    assert custom_notification("k") == {"type": "custom", "key": "k"}
    assert custom_notification("k", {}) == msgspec.to_builtins(_PrCustomNotification("k"))
    assert msgspec.msgpack.encode([custom_notification("k", {"a": 1})]) == msgspec.msgpack.encode(
        [_PrCustomNotification("k", {"a": 1})]
    )


def test_the_trailing_field_is_absent_unless_given() -> None:
    assert len(msgspec.msgpack.decode(encode_utility_reply(0, 1, value=1))) == 9
    for notifications in (None, [], [NOTIFICATION], "anything"):
        reply = encode_utility_reply(0, 1, value=1, engine_notifications=notifications)
        assert msgspec.msgpack.decode(reply)[9:] == [notifications]


def test_handshake_vectors(vectors: dict[str, bytes]) -> None:
    assert (
        encode_handshake_message("HELLO", local=False, headless=True) == vectors["hello_headless"]
    )
    assert (
        encode_handshake_message("READY", local=False, headless=True) == vectors["ready_headless"]
    )
    assert encode_handshake_message("READY", parallel_config_hash="abc") == vectors["ready_dp_hash"]
    ready = decode_handshake_message(vectors["ready_dp_hash"])
    assert (ready.status, ready.local, ready.headless) == ("READY", False, True)
    assert ready.extra == {"parallel_config_hash": "abc"}


def test_init_vectors(vectors: dict[str, bytes]) -> None:
    init = encode_init(["tcp://127.0.0.1:5001"], ["tcp://127.0.0.1:5002"])
    assert init == vectors["init_minimal"]
    for name in ("init_minimal", "init_minimal_omitted_optionals"):
        decoded = decode_init(vectors[name])
        assert decoded.addresses.inputs == ["tcp://127.0.0.1:5001"]
        assert decoded.addresses.outputs == ["tcp://127.0.0.1:5002"]
        assert decoded.addresses.coordinator_input is None
        assert decoded.parallel_config == {}


def test_registration_vector(vectors: dict[str, bytes]) -> None:
    fields = registration_map(1, enable_sleep_mode=False, data_parallel_size=2)
    assert len(fields) == 28
    assert encode_registration(fields) == vectors["ready_response_example"]
    info = decode_registration(vectors["ready_response_example"])
    assert (info.vllm_version, info.enable_sleep_mode, info.data_parallel_rank) == (
        "0.33.0",
        False,
        1,
    )


def test_engine_core_dead_and_identity(vectors: dict[str, bytes]) -> None:
    assert vectors["engine_core_dead"] == ENGINE_CORE_DEAD
    assert engine_identity(0) == b"\x00\x00"
    assert engine_identity(1) == b"\x01\x00"
    assert engine_identity(258) == b"\x02\x01"
    assert identity_engine_index(b"\x02\x01") == 258
    assert identity_engine_index(b"engine-x") is None
    with pytest.raises(ValueError):
        engine_identity(65536)


@pytest.mark.parametrize("call_id", [0, 1, 2**32, 2**63 - 1, 2**63, 2**63 + 12345, 2**64 - 1])
def test_uint64_call_ids_round_trip(call_id: int) -> None:
    decoded = decode_utility_request(encode_utility_request(0, call_id, "is_sleeping"))
    assert decoded.call_id == call_id
    reply = decode_engine_outputs(encode_utility_reply(3, call_id, value=False))
    assert reply.utility is not None and reply.utility.call_id == call_id


def test_call_id_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError):
        encode_utility_request(0, 2**64, "is_sleeping")
    with pytest.raises(ValueError):
        encode_utility_request(0, -1, "is_sleeping")


def test_reply_arrays_of_other_lengths(vectors: dict[str, bytes]) -> None:
    """8 positions (before weight_version) and 12 (future fields) decode like 9 (case 6)."""
    import msgspec

    nine = msgspec.msgpack.decode(vectors["eco_utility_true_e1"])
    for variant in (nine[:8], [*nine, None, 1, "x"]):
        out = decode_engine_outputs(msgspec.msgpack.encode(variant))
        assert out.engine_index == 1
        assert out.utility is not None and (out.utility.call_id, out.utility.value) == (7, True)


def test_results_nil_and_type_info() -> None:
    """[nil, value] and [type_info, value] give value; [nil, nil] gives None (case 7)."""
    import msgspec

    for result, expected in (([None, True], True), ([["m", "q"], 5], 5), ([None, None], None)):
        frame = msgspec.msgpack.encode([0, [], None, 0.0, [1, None, result]])
        out = decode_engine_outputs(frame)
        assert out.utility is not None and out.utility.value == expected


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02",  # array of 3 with missing element
        b"\x91\xc3",  # engine_index is a bool
        b"\x95\x00\x90\xc0\xcb\x00\x00\x00\x00\x00\x00\x00\x00\x93\xa1x\xc0\xc0",  # call id str
        b"\x80",  # a map
    ],
)
def test_malformed_outputs_raise_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_engine_outputs(payload)


def test_registration_forms() -> None:
    """Full, 17-key, extra-key and empty registrations are all accepted (case 3)."""
    full = registration_map(2)
    seventeen = dict(list(full.items())[:17])
    extra = {**full, "future_key": [1, 2]}
    for fields in (full, seventeen, extra):
        info = decode_registration(encode_registration(fields))
        assert info.vllm_version == "0.33.0" and info.data_parallel_rank == 2
    assert decode_registration(b"").vllm_version is None
    with pytest.raises(ProtocolError):
        decode_registration(b"\x93\x01\x02\x03")


@pytest.mark.parametrize(
    "init",
    [
        {"addresses": {"inputs": ["a"], "outputs": ["b"]}},  # parallel_config missing
        {"addresses": {"inputs": ["a"]}, "parallel_config": {}},  # outputs missing
        {"addresses": {"inputs": ["a"], "outputs": ["b"]}, "parallel_config": {"x": True}},
        {"addresses": {"inputs": ["a"], "outputs": ["b"]}, "parallel_config": {"x": 1.5}},
        {"addresses": {"inputs": ["a"], "outputs": ["b"]}, "parallel_config": {"x": None}},
        [{"inputs": ["a"], "outputs": ["b"]}, {}],  # array instead of map
    ],
)
def test_init_strict_engine_rules(init: object) -> None:
    import msgspec

    with pytest.raises(ProtocolError):
        decode_init(msgspec.msgpack.encode(init))


def test_init_unknown_keys_and_several_slots_accepted() -> None:
    import msgspec

    init = {
        "addresses": {"inputs": ["a", "c"], "outputs": ["b", "d"], "new": 1},
        "parallel_config": {"data_parallel_size": 2, "_data_parallel_master_port_list": [1, 2]},
        "extra": "ignored",
    }
    decoded = decode_init(msgspec.msgpack.encode(init))
    assert decoded.addresses.inputs == ["a", "c"] and decoded.addresses.outputs == ["b", "d"]
