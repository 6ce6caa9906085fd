"""Property tests: round trips, and arbitrary bytes never raise anything but ProtocolError."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.error import ProtocolError
from exporter.protocol import (
    decode_engine_outputs,
    decode_handshake_message,
    decode_init,
    decode_registration,
    decode_utility_request,
    encode_utility_reply,
    encode_utility_request,
)
from exporter.protocol.utility import MAX_CLIENT_INDEX

DECODERS: list[Callable[[bytes], Any]] = [
    decode_engine_outputs,
    decode_handshake_message,
    decode_init,
    decode_registration,
    decode_utility_request,
]

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6)
    ),
    max_leaves=20,
)


def _only_protocol_errors(payload: bytes) -> None:
    for decode in DECODERS:
        with contextlib.suppress(ProtocolError):
            decode(payload)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_arbitrary_bytes_only_raise_protocol_error(payload: bytes) -> None:
    _only_protocol_errors(payload)


@settings(max_examples=300, deadline=None)
@given(msgpack_values)
def test_arbitrary_msgpack_only_raises_protocol_error(value: Any) -> None:
    _only_protocol_errors(msgspec.msgpack.encode(value))


@settings(max_examples=200, deadline=None)
@given(
    client_index=st.integers(0, MAX_CLIENT_INDEX),
    call_id=st.integers(0, 2**64 - 1),
    method=st.text(min_size=1, max_size=30),
    args=st.lists(
        st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.text(max_size=10), max_size=4
    ),
)
def test_request_round_trip(client_index: int, call_id: int, method: str, args: list[Any]) -> None:
    decoded = decode_utility_request(
        encode_utility_request(client_index, call_id, method, tuple(args))
    )
    assert (decoded.client_index, decoded.call_id, decoded.method) == (
        client_index,
        call_id,
        method,
    )
    assert list(decoded.args) == args


@settings(max_examples=200, deadline=None)
@given(
    engine_index=st.integers(0, 65535),
    call_id=st.integers(0, 2**64 - 1),
    value=st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=10),
    failure=st.none() | st.text(max_size=40),
)
def test_reply_round_trip(engine_index: int, call_id: int, value: Any, failure: str | None) -> None:
    frame = encode_utility_reply(
        engine_index, call_id, value=value, failure_message=failure, timestamp=1.5
    )
    out = decode_engine_outputs(frame)
    assert out.engine_index == engine_index and out.utility is not None
    assert out.utility.call_id == call_id
    assert out.utility.failure_message == failure
    assert out.utility.value == (None if failure is not None else value)
