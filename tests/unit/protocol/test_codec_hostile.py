"""Hostile bytes for every decoder (docs/reliability.md, row A4): deep nesting, huge declared
lengths, and every msgpack type at every position of the structures the exporter decodes. Whatever
the bytes, a decoder returns or raises ``ProtocolError``; nothing else escapes."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
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
)
from exporter.protocol.relay import append_client_slot

DECODERS: dict[str, Callable[[bytes], Any]] = {
    "outputs": decode_engine_outputs,
    "handshake": decode_handshake_message,
    "init": decode_init,
    "registration": decode_registration,
    "request": decode_utility_request,
    "relay_init": lambda b: append_client_slot(b, "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"),
}


def only_protocol_errors(payload: bytes) -> list[str]:
    """Run every decoder; return the ProtocolError kinds raised (anything else fails)."""
    kinds = []
    for decode in DECODERS.values():
        try:
            decode(payload)
        except ProtocolError as exc:
            kinds.append(exc.kind)
    return kinds


def nested(depth: int, leaf: bytes = b"\xc0", opener: bytes = b"\x91") -> bytes:
    return opener * depth + leaf


@pytest.mark.parametrize("depth", [1_000, 5_000, 200_000])
@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\xde\x00\x01\xa1k"])
def test_deep_nesting_is_a_protocol_error(depth: int, opener: bytes) -> None:
    kinds = only_protocol_errors(nested(depth, opener=opener))
    assert "too_deep" in kinds


@pytest.mark.parametrize("position", range(9))
def test_deep_nesting_at_every_position_of_a_reply(position: int) -> None:
    deep = msgspec.Raw(nested(5_000))
    fields: list[Any] = [1, [], None, 1.0, [7, None, [None, True]], None, None, None, None]
    fields[position] = deep
    with pytest.raises(ProtocolError) as err:
        decode_engine_outputs(msgspec.msgpack.encode(fields))
    assert err.value.kind in ("too_deep", "wrong_shape")


def test_deep_nesting_inside_a_utility_result() -> None:
    reply = [1, [], None, 1.0, [7, None, [None, msgspec.Raw(nested(5_000))]], None]
    with pytest.raises(ProtocolError) as err:
        decode_engine_outputs(msgspec.msgpack.encode(reply))
    assert err.value.kind == "too_deep"


HUGE_HEADERS = {
    "array32": b"\xdd" + struct.pack(">I", 0xFFFFFFFF),
    "map32": b"\xdf" + struct.pack(">I", 0xFFFFFFFF),
    "str32": b"\xdb" + struct.pack(">I", 0xFFFFFFFF),
    "bin32": b"\xc6" + struct.pack(">I", 0xFFFFFFFF),
    "ext32": b"\xc9" + struct.pack(">I", 0xFFFFFFFF) + b"\x01",
    "array16": b"\xdc\xff\xff",
    "map16": b"\xde\xff\xff",
}


@pytest.mark.parametrize("header", list(HUGE_HEADERS))
def test_huge_declared_lengths_are_protocol_errors(header: str) -> None:
    payload = HUGE_HEADERS[header] + b"\x00" * 16
    assert only_protocol_errors(payload), "every decoder must reject it"
    # ... and inside an otherwise valid reply.
    reply = [1, [], None, 1.0, [7, None, [None, msgspec.Raw(payload)]]]
    with pytest.raises(ProtocolError):
        decode_engine_outputs(msgspec.msgpack.encode(reply))


#: One value of every msgpack type (nil, bool, ints of every width, floats, str, bin, array,
#: map, ext, timestamp ext).
EVERY_TYPE: list[bytes] = [
    b"\xc0",
    b"\xc2",
    b"\xc3",
    b"\x05",
    b"\xff",
    b"\xcc\xff",
    b"\xcd\xff\xff",
    b"\xce\xff\xff\xff\xff",
    b"\xcf" + b"\xff" * 8,
    b"\xd0\x80",
    b"\xd3" + b"\x80" + b"\x00" * 7,
    b"\xca" + struct.pack(">f", 1.5),
    b"\xcb" + struct.pack(">d", float("nan")),
    b"\xa3abc",
    b"\xc4\x03abc",
    b"\x93\x01\x02\x03",
    b"\x81\xa1k\xc3",
    b"\xd4\x05\x01",
    b"\xd6\xff\x00\x00\x00\x01",
]


@pytest.mark.parametrize("value", EVERY_TYPE, ids=lambda b: b[:1].hex())
@pytest.mark.parametrize("position", range(12))
def test_every_msgpack_type_at_every_reply_position(value: bytes, position: int) -> None:
    """Positions 0-8 of EngineCoreOutputs and beyond (a longer array is accepted)."""
    base: list[Any] = [1, [], None, 1.0, [7, None, [None, True]], None, None, None, None]
    base += [None] * (position + 1 - len(base))
    base[position] = msgspec.Raw(value)
    payload = msgspec.msgpack.encode(base)
    only_protocol_errors(payload)


@pytest.mark.parametrize("value", EVERY_TYPE, ids=lambda b: b[:1].hex())
@pytest.mark.parametrize("position", range(3))
def test_every_msgpack_type_at_every_utility_output_position(value: bytes, position: int) -> None:
    utility: list[Any] = [7, None, [None, True]]
    utility[position] = msgspec.Raw(value)
    reply = [1, [], None, 1.0, utility, None, None, None, None]
    only_protocol_errors(msgspec.msgpack.encode(reply))


@pytest.mark.parametrize("value", EVERY_TYPE, ids=lambda b: b[:1].hex())
@pytest.mark.parametrize("key", ["status", "local", "headless", "addresses", "parallel_config"])
def test_every_msgpack_type_in_every_handshake_field(value: bytes, key: str) -> None:
    message: dict[str, Any] = {
        "status": "HELLO",
        "local": False,
        "headless": True,
        "addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://a:2"]},
        "parallel_config": {},
    }
    message[key] = msgspec.Raw(value)
    only_protocol_errors(msgspec.msgpack.encode(message))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.integers(1, 3000))
def test_random_suffix_after_deep_prefix(suffix: bytes, depth: int) -> None:
    only_protocol_errors(nested(depth, leaf=suffix or b"\xc0"))


def test_a_valid_reply_still_decodes() -> None:
    out = decode_engine_outputs(encode_utility_reply(3, 9, value=True))
    assert out.engine_index == 3 and out.utility is not None and out.utility.value is True
