"""The one rule for strings that engines send: cut where a reply is decoded, in every mode.

An engine (or an API server in HTTP mode) can answer a weight version, a failure text or a
nested result holding strings of up to a frame's size. Each of them reaches a Prometheus label,
``/status``, the status page, ``/gate``, admin answers and log lines, so :func:`bound_text` cuts
every engine-supplied string to at most :data:`MAX_ENGINE_STRING` bytes of UTF-8 (a label then
stays under any sane ``label_value_length_limit``) and ends a cut one with a visible marker,
``…[cut:<12 hex digits>]``. The digits are a digest of the whole string, so two long strings
that differ after their first bytes stay different: a cut can never turn a disagreement
between engines into a false consensus. :func:`bound_value` applies the rule to every string
(and map key) of a nested result. Registration strings (``vllm_version``) keep their own, older
rule: 64 characters, cut silently (``exporter.protocol.handshake``). docs/protocol.md,
"Strings engines send".
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

#: Longest engine-supplied string kept, in UTF-8 bytes (marker included).
MAX_ENGINE_STRING = 256
#: How a cut string continues after what was kept: ``…[cut:`` + digest + ``]``.
CUT_MARKER = "…[cut:"
_DIGEST_HEX = 12
_MARKER_BYTES = len(CUT_MARKER.encode()) + _DIGEST_HEX + 1
_CUT_SUFFIX = re.compile(r"…\[cut:[0-9a-f]{12}\]\Z")
#: Lone surrogates (possible from JSON ``\ud800`` escapes) cannot be encoded as UTF-8; every
#: exposition format would fail on them.
_SURROGATES = re.compile("[\ud800-\udfff]")
#: Containers nested deeper than this inside a result are replaced by :data:`TOO_DEEP`.
MAX_RESULT_NESTING = 32
TOO_DEEP = "…[cut: nested too deeply]"


def ascii_digits(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits: a rank, port or length from a peer. Not
    ``str.isdigit``, which takes "²" (then ``int()`` raises) and the Arabic-Indic one
    (``int()`` reads 1)."""
    return text.isascii() and text.isdigit()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_HEX // 2).hexdigest()


def bound_text(text: str, limit: int = MAX_ENGINE_STRING) -> str:
    """``text`` unchanged when its UTF-8 fits ``limit`` bytes; otherwise its first bytes (never
    half a character) and the cut marker, ``limit`` bytes at most. Lone surrogates become
    U+FFFD."""
    if len(text) <= limit and text.isascii():
        return text
    whole = len(text) <= limit  # more characters than ``limit`` means more bytes, too
    head = _SURROGATES.sub("\ufffd", text if whole else text[:limit])
    raw = head.encode()
    if whole and len(raw) <= limit:
        return head
    full = text.encode("utf-8", "surrogatepass")
    kept = raw[: max(0, limit - _MARKER_BYTES)].decode("utf-8", "ignore")
    return f"{kept}{CUT_MARKER}{_digest(full)}]"


def bound_bytes(data: bytes, limit: int = MAX_ENGINE_STRING) -> bytes:
    """The :func:`bound_text` rule for a msgpack ``bin`` value (the marker in ASCII bytes)."""
    if len(data) <= limit:
        return data
    marker = f"{CUT_MARKER}{_digest(data)}]".encode()
    return data[: max(0, limit - len(marker))] + marker


def is_cut(text: str) -> bool:
    """Whether ``text`` ends with the cut marker (it was longer than the cap)."""
    return _CUT_SUFFIX.search(text) is not None


def bound_value(value: Any, depth: int = 0) -> Any:
    """``value`` with every string and bytes value, and every map key, cut by the rule above.

    Results are small trees (a bool, a version, a list of ``{key: digest}`` maps); a container
    deeper than :data:`MAX_RESULT_NESTING` becomes :data:`TOO_DEEP` (nothing real nests so).
    Anything else (numbers, booleans, None, extension types) is returned as it is.
    """
    kind = type(value)
    if kind is bool or value is None:  # most replies: is_sleeping, is_scheduler_paused
        return value
    if kind is str:
        if len(value) <= MAX_ENGINE_STRING and value.isascii():
            return value
        return bound_text(value)
    if kind is int or kind is float:
        return value
    if kind is bytes:
        return bound_bytes(value)
    if kind is list or kind is tuple or kind is dict:
        if depth >= MAX_RESULT_NESTING:
            return TOO_DEEP
        if kind is dict:
            return {bound_value(k, depth + 1): bound_value(v, depth + 1) for k, v in value.items()}
        items = [bound_value(v, depth + 1) for v in value]
        return items if kind is list else tuple(items)
    return value
