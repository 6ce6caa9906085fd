"""``exporter/protocol/codec.py``: the one place bytes from a peer become values; every failure
is a ``ProtocolError`` of one of three kinds, naming what was being read. The decoders built on
it, against arbitrary and hostile bytes, are tests/unit/protocol/test_codec_fuzz.py and
test_codec_hostile.py."""

from __future__ import annotations

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol.codec import decode, decode_any


class Pair(msgspec.Struct, array_like=True):
    name: str
    count: int


PAIRS = msgspec.msgpack.Decoder(Pair)


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (msgspec.msgpack.encode(["a", "not a count"]), "wrong_shape"),
        (msgspec.msgpack.encode({"name": "a"}), "wrong_shape"),
        (b"\xc1", "not_msgpack"),
        (msgspec.msgpack.encode(["a", 1])[:-1], "not_msgpack"),  # truncated
        (b"\x91\x91\xc0", "wrong_shape"),  # nested where a name belongs
    ],
)
def test_each_failure_is_one_kind_of_protocol_error_naming_what_was_read(
    payload: bytes, kind: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(payload, "a pair", PAIRS)
    assert info.value.kind == kind
    assert "a pair" in str(info.value)


def test_what_decodes_is_returned_typed_or_as_plain_values() -> None:
    assert decode(msgspec.msgpack.encode(["a", 2]), "a pair", PAIRS) == Pair("a", 2)
    value = decode_any(msgspec.msgpack.encode({"k": [1, b"\x00", None]}), "a map")
    assert value == {"k": [1, b"\x00", None]}
