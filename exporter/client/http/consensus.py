"""vLLM's consensus error, read with bounded work: the values of "Engines returned different
<method> results: [...]" (the Python API server's, a Python list repr, also behind a route's
own prefix) or "utility call `<method>` returned inconsistent results across engines: [...]"
(the Rust front end's, JSON values).

A hostile server can send a 4 MiB error message, so nothing here runs a regex over the whole
message, ``ast`` or a JSON parser over the list: a message over ``MAX_CONSENSUS_MESSAGE`` is
refused before any work, the marker is found with ``str.find`` and the rest must follow it
exactly, and one linear scan reads the list: each value at most ``MAX_VALUE_CHARS`` long, the
first ``MAX_INCONSISTENT_VALUES`` decoded and kept (strings decoded here, nested containers kept
as their cut source text), the rest only checked and counted. Anything else is not a consensus
error: the caller reads the answer as a failure (pure).
"""

from __future__ import annotations

import json
import re
import unicodedata
from typing import Any

from exporter.protocol.strings import bound_text

#: The longest message read as a consensus error (characters). One value per engine behind one
#: API server: 1,024 engines with 64-character values fit; anything longer is a failure, refused
#: before any parse (one scan of the bound costs milliseconds; a regex or ``ast`` over 4 MiB
#: cost seconds and hundreds of MB).
MAX_CONSENSUS_MESSAGE = 128 * 1024
#: Values of one inconsistent answer decoded and kept (one per engine of that API server); the
#: rest are checked, counted and summed up in one last marker value.
MAX_INCONSISTENT_VALUES = 1024
#: The longest one value's text may be (a string literal with its quotes, a number, a nested
#: value): a weight version is a name or a digest, far shorter; a longer value is refused.
MAX_VALUE_CHARS = 16 * 1024
#: How deep a nested value (a tuple, a map) may nest before the message is refused.
MAX_VALUE_DEPTH = 32

PYTHON_MARKER = "Engines returned different "
RUST_MARKER = "utility call `"
_WORDS: dict[bool, dict[str, Any]] = {
    True: {
        "True": True,
        "False": False,
        "None": None,
        "nan": float("nan"),
        "inf": float("inf"),
        "-inf": float("-inf"),
    },
    False: {  # and the words Python's own JSON decoder takes
        "true": True,
        "false": False,
        "null": None,
        "NaN": float("nan"),
        "Infinity": float("inf"),
        "-Infinity": float("-inf"),
    },
}
_OPEN = {"[": "]", "(": ")", "{": "}"}
_SPACE = re.compile(r"[ \t\r\n]*")
#: A scalar (a word or a number: at most 64 characters) and the separator after it.
_SCALAR = re.compile(r"([A-Za-z0-9_+\-.]{1,64})[ \t\r\n]*([,\]])")
_NUMERIC = re.compile(r"[0-9+\-.eE]+")
#: What a nested value's scan stops at: brackets and the quotes strings open with.
_NESTED = {True: re.compile(r"[\[\](){}'\"]"), False: re.compile(r"[\[\](){}\"]")}
#: One escape of a Python string literal (repr's and the rest of the language's); an ``x``,
#: ``u``, ``U`` or ``N`` not followed by its digits or name is refused, as Python refuses it.
_PY_ESCAPE = re.compile(
    r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|N\{[A-Za-z0-9 \-]{1,88}\}|[0-7]{1,3}|.)",
    re.DOTALL,
)
_PY_SIMPLE = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
}
_JSON_CONTROL = re.compile(r"[\x00-\x1f]")


class _Refused(Exception):
    """A value the scanner will not read: the message is then not a consensus error."""


def parse_inconsistent(message: str, method: str) -> tuple[Any, ...] | None:
    """The values of ``method``'s consensus error in ``message``, or None when it is not one."""
    if len(message) > MAX_CONSENSUS_MESSAGE:
        return None
    text = message.strip()
    for marker, tail, python in (
        (PYTHON_MARKER, f"{method} results: ", True),
        (RUST_MARKER, f"{method}` returned inconsistent results across engines: ", False),
    ):
        start = _after_marker(text, marker, tail)
        if start is not None:
            return read_values(text, start, python)
    return None


def _after_marker(text: str, marker: str, tail: str) -> int | None:
    """Where the value list starts: right after the first ``marker`` + ``tail`` that stands at
    the start of ``text`` or after ": " (a route's own prefix)."""
    at = text.find(marker)
    while at >= 0:
        if at == 0 or text.startswith(": ", at - 2):
            end = at + len(marker)
            if text.startswith(tail, end):
                return end + len(tail)
        at = text.find(marker, at + 1)
    return None


def read_values(text: str, start: int, python: bool) -> tuple[Any, ...] | None:
    """The list at ``text[start:]``, which must end ``text``: Python literals (``python``) or
    JSON values; None for anything else. One pass, each step past one value and what follows
    it (a scalar and its separator in one anchored match of at most 64 characters)."""
    if not text.startswith("[", start):
        return None
    at, more = _skip_space(text, start + 1), 0
    kept: list[Any] = []
    if text.startswith("]", at):
        return () if at + 1 == len(text) else None
    try:
        while True:
            keep = len(kept) < MAX_INCONSISTENT_VALUES
            scalar = _SCALAR.match(text, at)
            if scalar is not None:
                value, separator, at = _scalar(scalar.group(1), python), scalar[2], scalar.end()
            else:
                value, at = _value(text, at, python, keep)
                at = _skip_space(text, at)
                separator, at = text[at : at + 1], at + 1
                if separator not in (",", "]"):
                    return None
            if keep:
                kept.append(value)
            else:
                more += 1
            if separator == "]":
                break
            at = _skip_space(text, at)
    except _Refused:
        return None
    if at != len(text):
        return None
    if more:
        kept.append(f"…[cut: {more} more values]")
    return tuple(kept)


def _skip_space(text: str, at: int) -> int:
    match = _SPACE.match(text, at)
    return match.end() if match else at


def _value(text: str, at: int, python: bool, keep: bool) -> tuple[Any, int]:
    """One string, bytes or nested value at ``at`` (decoded when ``keep``, else only checked)
    and where it ends. (A scalar is read with its separator: anything else here is refused.)"""
    first = text[at : at + 1]
    if first == '"' or (python and first == "'"):
        end = _string_end(text, at)
        return (_decode(text[at + 1 : end - 1], python) if keep else None), end
    if python and text.startswith(("b'", 'b"'), at):  # bytes: kept as their repr
        end = _string_end(text, at + 1)
        return (bound_text(text[at:end]) if keep else None), end
    if first in _OPEN:
        end = _nested_end(text, at, python)
        return (bound_text(text[at:end]) if keep else None), end
    raise _Refused


def _scalar(token: str, python: bool) -> Any:
    """A word (``True``, ``null``, ...) or a number of at most 64 characters."""
    words = _WORDS[python]
    if token in words:
        return words[token]
    if not _NUMERIC.fullmatch(token):
        raise _Refused
    try:
        return int(token)
    except ValueError:
        pass
    try:
        return float(token)
    except ValueError:
        raise _Refused from None


def _string_end(text: str, at: int) -> int:
    """The index after the string literal opening at ``at`` (its quote escaped by an odd run of
    backslashes skipped), at most ``MAX_VALUE_CHARS`` on: each character looked at once."""
    quote, i = text[at], at + 1
    limit = min(len(text), at + MAX_VALUE_CHARS)
    while True:
        j = text.find(quote, i, limit)
        if j < 0:
            raise _Refused
        k = j
        while k > i and text[k - 1] == "\\":
            k -= 1
        if (j - k) % 2 == 0:
            return j + 1
        i = j + 1


def _decode(body: str, python: bool) -> str:
    """A string literal's body (at most ``MAX_VALUE_CHARS``) → its value, cut."""
    if python:
        if "\n" in body or "\r" in body:
            raise _Refused
        value = _PY_ESCAPE.sub(_py_escape, body) if "\\" in body else body
    elif "\\" in body:
        try:  # one bounded string literal, never the list: C, linear
            value = json.loads(f'"{body}"')
        except ValueError:
            raise _Refused from None
    elif _JSON_CONTROL.search(body):
        raise _Refused
    else:
        value = body
    return bound_text(value)


def _py_escape(match: re.Match[str]) -> str:
    """One escape of a Python string literal → its character(s)."""
    code = match.group(1)
    kind = code[0]
    if kind in "xuU" and len(code) > 1:
        if int(code[1:], 16) > 0x10FFFF:  # Python refuses it too
            raise _Refused
        return chr(int(code[1:], 16))
    if kind == "N" and len(code) > 1:
        try:
            return unicodedata.lookup(code[2:-1])
        except KeyError:
            raise _Refused from None
    if kind in "01234567":
        return chr(int(code, 8))
    if kind in "xuUN":
        raise _Refused
    return _PY_SIMPLE.get(kind, "\\" + kind)  # an unknown escape stays, as in Python


def _nested_end(text: str, at: int, python: bool) -> int:
    """The index after the container opening at ``at``: brackets matched, strings skipped, at
    most ``MAX_VALUE_DEPTH`` deep and ``MAX_VALUE_CHARS`` long (kept as its cut text)."""
    closing = [_OPEN[text[at]]]
    limit = min(len(text), at + MAX_VALUE_CHARS)
    find, i = _NESTED[python].search, at + 1
    while (match := find(text, i, limit)) is not None:
        c, i = match.group(), match.end()
        if c in "'\"":
            i = _string_end(text, match.start())
        elif c in _OPEN:
            if len(closing) >= MAX_VALUE_DEPTH:
                raise _Refused
            closing.append(_OPEN[c])
        elif c != closing.pop():
            raise _Refused
        elif not closing:
            return i
    raise _Refused
