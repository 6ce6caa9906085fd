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
    MAX_CLIENT_INDEX,
    decode_engine_outputs,
    decode_utility_request,
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
