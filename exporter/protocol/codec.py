"""The one place where bytes from a peer become Python values.

Every decoder of the protocol package goes through :func:`decode`, so that whatever the bytes
(not msgpack, the wrong shape, nesting deep enough to exhaust msgspec's recursion limit, huge
declared lengths), the only exception that leaves the package is ``ProtocolError``.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from exporter.error import ProtocolError

T = TypeVar("T")

_untyped = msgspec.msgpack.Decoder()


def decode(payload: bytes, what: str, decoder: msgspec.msgpack.Decoder[T] | None = None) -> T:
    """Decode ``payload`` with ``decoder`` (untyped when None); ``ProtocolError`` otherwise.

    ``kind`` tells the failures apart for ``vllm_dp_protocol_errors_total``: ``wrong_shape``
    (valid msgpack, wrong structure), ``not_msgpack`` (invalid or truncated), ``too_deep``
    (nesting beyond msgspec's recursion limit, which it reports as ``RecursionError``).
    """
    try:
        if decoder is None:
            value: T = _untyped.decode(payload)
            return value
        return decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise ProtocolError("wrong_shape", f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ProtocolError("not_msgpack", f"{what}: {exc}") from None
    except RecursionError:
        raise ProtocolError("too_deep", f"{what}: nested too deeply") from None


def decode_any(payload: bytes, what: str) -> Any:
    """Untyped decode (maps stay dicts, arrays become lists)."""
    return decode(payload, what)
