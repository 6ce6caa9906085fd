"""Relay mode's one INIT rewrite: append the exporter's client slot to an upstream INIT.

The front end's INIT must reach the engine unchanged except for one more input and one more
output address (``docs/protocol.md`` F.5): every other key and value, ``parallel_config``
included, must stay byte for byte what the front end sent (for MoE DP its hash is checked in
READY). The rewrite therefore decodes the INIT as an untyped map (msgspec keeps key order),
checks that re-encoding the *unmodified* map gives back the original bytes (so the encoder is
known to reproduce every other byte), appends to the two lists and re-encodes. Anything it cannot
do exactly raises ``ProtocolError``; the caller then forwards the original INIT unchanged.
"""

from __future__ import annotations

from typing import Any

import msgspec

from exporter.error import ProtocolError
from exporter.protocol.codec import decode_any
from exporter.protocol.handshake import decode_init

_encoder = msgspec.msgpack.Encoder()


def _string_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ProtocolError("init_wrong_shape", f"INIT addresses.{what} is not a list of strings")
    return value


def append_client_slot(init: bytes, input_address: str, output_address: str) -> tuple[bytes, int]:
    """Return ``(new_init, client_index)``: ``init`` with one more input and output address.

    ``client_index`` is the slot the appended pair occupies, ``len(original inputs)``; the
    exporter must send it in every request (one too high kills the engine's output thread).
    Raises ``ProtocolError`` when the INIT is not one an engine accepts, when its input and
    output lists differ in length, or when it is not in the canonical encoding that would let
    the rewrite keep every other byte.
    """
    decode_init(init)  # what a vLLM engine accepts; ProtocolError otherwise
    obj = decode_any(init, "INIT")
    if _encoder.encode(obj) != init:
        raise ProtocolError(
            "init_not_canonical",
            "INIT does not re-encode to the same bytes; refusing to rewrite it",
        )
    if not isinstance(obj, dict):  # pragma: no cover - decode_init already checked
        raise ProtocolError("init_wrong_shape", "INIT is not a map")
    addresses = obj.get("addresses")
    if not isinstance(addresses, dict):  # pragma: no cover - decode_init already checked
        raise ProtocolError("init_wrong_shape", "INIT addresses is not a map")
    inputs = _string_list(addresses.get("inputs"), "inputs")
    outputs = _string_list(addresses.get("outputs"), "outputs")
    if len(inputs) != len(outputs):
        raise ProtocolError(
            "init_slot_mismatch",
            f"INIT has {len(inputs)} inputs but {len(outputs)} outputs; no slot to append",
        )
    client_index = len(inputs)
    inputs.append(input_address)
    outputs.append(output_address)
    return _encoder.encode(obj), client_index


def strip_client_slot(init: bytes, client_index: int) -> bytes:
    """Inverse of :func:`append_client_slot` for checks: drop slot ``client_index`` again."""
    obj = decode_any(init, "INIT")
    addresses = obj["addresses"]
    del addresses["inputs"][client_index]
    del addresses["outputs"][client_index]
    return _encoder.encode(obj)
