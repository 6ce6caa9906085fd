"""``exporter/protocol/utility.py``: UTILITY requests and ``EngineCoreOutputs`` replies (pure).
Byte-exact vectors, reply arrays of other lengths and call-id bounds are in
tests/unit/protocol/test_vectors.py; round trips of arbitrary values in
tests/unit/protocol/test_codec_fuzz.py."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol.strings import MAX_ENGINE_STRING, is_cut
from exporter.protocol.utility import (
    KNOWN_OUTPUT_POSITIONS,
    MAX_CLIENT_INDEX,
    EngineCoreOutputsWire,
    custom_notification,
    decode_engine_outputs,
    decode_utility_request,
    encode_notifications_output,
    encode_utility_reply,
    encode_utility_request,
    reset_args,
    unwrap_result,
)


@pytest.mark.parametrize("client_index", [-1, MAX_CLIENT_INDEX + 1, True, 1.0])
def test_a_client_index_an_engine_could_not_index_is_never_encoded(client_index: Any) -> None:
    with pytest.raises(ValueError, match="client_index"):
        encode_utility_request(client_index, 1, "is_sleeping")


def test_the_highest_client_index_and_the_arguments_reach_the_engine() -> None:
    frame = encode_utility_request(MAX_CLIENT_INDEX, 7, "sleep", (1, "wait"))
    request = decode_utility_request(frame)
    assert (request.client_index, request.call_id, request.method) == (MAX_CLIENT_INDEX, 7, "sleep")
    assert request.args == (1, "wait")


@pytest.mark.parametrize("result", [[1], [None, 1, 2], "value", {"type": None, "value": 1}])
def test_a_result_that_is_not_type_info_and_value_is_the_wrong_shape(result: Any) -> None:
    with pytest.raises(ProtocolError) as info:
        unwrap_result(result)
    assert info.value.kind == "wrong_shape"
    frame = msgspec.msgpack.encode([0, [], None, 0.0, [3, None, result]])
    with pytest.raises(ProtocolError):
        decode_engine_outputs(frame)


def test_an_output_without_a_utility_answer_is_no_reply() -> None:
    out = decode_engine_outputs(msgspec.msgpack.encode([2, [], None, 0.0, None]))
    assert (out.engine_index, out.utility) == (2, None)


def test_a_success_and_a_failure_as_an_engine_encodes_them() -> None:
    success = decode_engine_outputs(encode_utility_reply(1, 9, value=None))
    assert success.utility is not None and success.utility.ok and success.utility.value is None
    assert msgspec.msgpack.decode(encode_utility_reply(1, 9, value=None))[4] == [
        9,
        None,
        [None, None],
    ]
    failure = decode_engine_outputs(encode_utility_reply(1, 9, failure_message="x" * 5000))
    reply = failure.utility
    assert reply is not None and not reply.ok and reply.value is None
    assert reply.failure_message is not None and is_cut(reply.failure_message)
    assert len(reply.failure_message.encode()) <= MAX_ENGINE_STRING
    assert msgspec.msgpack.decode(encode_utility_reply(1, 9, failure_message="no"))[4] == [
        9,
        "no",
        None,
    ]


@pytest.mark.parametrize(
    ("running", "connector", "args"),
    [
        (False, False, ()),
        (True, False, (True,)),
        (False, True, (False, True)),
        (True, True, (True, True)),
    ],
)
def test_the_reset_sends_no_argument_it_does_not_need(
    running: bool, connector: bool, args: tuple[bool, ...]
) -> None:
    assert reset_args(running, connector) == args


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


NOTE = custom_notification("lora", {"rank": 1, "gpu": ["a", "b"]})
#: What may follow the 9 known positions: vLLM PR #51433's ``engine_notifications`` in each of
#: its forms, and whatever a later vLLM appends after it. None of it is read.
TRAILING: dict[str, list[Any]] = {
    "notifications_nil": [None],
    "notifications_empty": [[]],
    "notifications_custom": [[NOTE]],
    "a_notification_tag_nobody_knows": [[{"type": "graceful_shutdown", "deadline_s": 30}]],
    "notifications_of_another_shape": [{"not": "a list"}],
    "notifications_then_two_more": [[NOTE], 3, {"future": [1.5, b"\x00"]}],
    "500_deep": [nested(500)],
}
REPLIES: dict[str, dict[str, Any]] = {
    "success": {"value": {"id": 1, "status": "healthy"}},
    "none": {"value": None},
    "failure": {"failure_message": "Call to sleep method failed: boom"},
}


@pytest.mark.parametrize("trailing", TRAILING.values(), ids=TRAILING.keys())
@pytest.mark.parametrize("call_id", [7, 2**64 - 1, -1, -2], ids=["7", "max", "eep", "ft"])
@pytest.mark.parametrize("reply", REPLIES.values(), ids=REPLIES.keys())
def test_elements_after_the_known_positions_are_skipped_unread(
    trailing: list[Any], call_id: int, reply: dict[str, Any]
) -> None:
    """Replies and pushes (call ids -1, -2) decode as the 9 positions of vLLM 0.33 do."""
    nine = encode_utility_reply(1, call_id, timestamp=5.0, **reply)
    longer = msgspec.msgpack.encode([*msgspec.msgpack.decode(nine), *trailing])
    assert len(msgspec.msgpack.decode(longer)) == KNOWN_OUTPUT_POSITIONS + len(trailing)
    assert decode_engine_outputs(longer) == decode_engine_outputs(nine)


def test_the_simulators_trailing_field_is_the_same_bytes_as_appending_it() -> None:
    for notifications in (None, [], [NOTE]):
        nine = encode_utility_reply(2, -2, value={"id": 2, "status": "dead"}, timestamp=1.5)
        ten = encode_utility_reply(
            2,
            -2,
            value={"id": 2, "status": "dead"},
            timestamp=1.5,
            engine_notifications=notifications,
        )
        assert ten == msgspec.msgpack.encode([*msgspec.msgpack.decode(nine), notifications])


@pytest.mark.parametrize(
    ("tail", "kind"),
    [
        (b"\xc1", "not_msgpack"),  # a byte msgpack never uses
        (b"\x92\xc0", "not_msgpack"),  # declared 2 elements, 1 given
        (b"\x91" * 5000 + b"\x90", "too_deep"),  # beyond msgspec's recursion limit
    ],
    ids=["invalid", "truncated", "5000_deep"],
)
def test_a_trailing_element_must_still_be_well_formed(tail: bytes, kind: str) -> None:
    """Skipped is not unchecked: the frame is still msgpack within the nesting bound."""
    body = encode_utility_reply(1, 7, value=True)[1:]  # the 9 elements after the array header
    with pytest.raises(ProtocolError) as info:
        decode_engine_outputs(b"\x9a" + body + tail)
    assert info.value.kind == kind


def test_the_decoder_skips_trailing_elements_on_purpose() -> None:
    """``forbid_unknown_fields=True`` would make every 10-position output ``wrong_shape``."""
    assert EngineCoreOutputsWire.__struct_config__.forbid_unknown_fields is False
    assert EngineCoreOutputsWire.__struct_config__.array_like is True
    assert len(EngineCoreOutputsWire.__struct_fields__) == KNOWN_OUTPUT_POSITIONS


#: Outputs without a utility reply: (positions, is it a notice?).
NON_UTILITY: dict[str, tuple[list[Any], bool]] = {
    "only_notifications": ([3, [], None, 1.0, None, None, None, None, None, [NOTE]], True),
    "notifications_and_a_weight_version": ([3, [], None, 1.0, *[None] * 4, "v7", [NOTE]], True),
    "nil_notifications": ([3, [], None, 1.0, None, None, None, None, None, None], True),
    "vllm_0_33_empty_output": ([3, [], None, 1.0, None, None, None, None, None], False),
    "request_output_with_notifications": ([3, [["r", [1]]], None, 1.0, *[None] * 5, [NOTE]], False),
    "stats_with_notifications": ([3, [], {"s": 1}, 1.0, *[None] * 5, [NOTE]], False),
    "finished_with_notifications": ([3, [], None, 1.0, None, ["r"], None, None, None, []], False),
    "wave_complete_with_notifications": ([3, [], None, 1.0, None, None, 4, None, None, []], False),
    "start_wave_with_notifications": ([3, [], None, 1.0, None, None, None, 5, None, []], False),
    "short": ([3, [], None, 1.0], False),
}


@pytest.mark.parametrize(("fields", "notice"), NON_UTILITY.values(), ids=NON_UTILITY.keys())
def test_an_output_whose_only_content_trails_the_known_positions_is_a_notice(
    fields: list[Any], notice: bool
) -> None:
    out = decode_engine_outputs(msgspec.msgpack.encode(fields))
    assert (out.engine_index, out.utility, out.notice) == (3, None, notice)


def test_a_notice_in_a_long_array_header() -> None:
    """array 16 and array 32 headers are read too (msgspec writes fixarray up to 15)."""
    body = msgspec.msgpack.encode([3, [], None, 1.0, None, None, None, None, None, [NOTE]])[1:]
    for header in (b"\xdc\x00\x0a", b"\xdd\x00\x00\x00\x0a"):
        assert decode_engine_outputs(header + body).notice
    nine = msgspec.msgpack.encode([3, [], None, 1.0, None, None, None, None, None])[1:]
    assert not decode_engine_outputs(b"\xdc\x00\x09" + nine).notice


def test_a_reply_is_never_a_notice() -> None:
    for notifications in (None, [NOTE]):
        reply = encode_utility_reply(1, 7, value=True, engine_notifications=notifications)
        assert not decode_engine_outputs(reply).notice
    frame = encode_notifications_output(2, [NOTE], timestamp=3.5)
    assert msgspec.msgpack.decode(frame) == [2, [], None, 3.5, *[None] * 5, [NOTE]]
