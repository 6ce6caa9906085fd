"""vLLM's consensus error, read with bounded work: the values of "Engines returned different
<method> results: [...]" (the Python API server's, a Python list repr, also behind a route's
own prefix) or "utility call `<method>` returned inconsistent results across engines: [...]"
(the Rust front end's, JSON values).

A hostile server can send a 4 MiB error message, so nothing here runs a regex, ``ast`` or a
JSON parser over the whole message: a message over ``MAX_CONSENSUS_MESSAGE`` is refused before
any work, the marker is found with ``str.find`` and the rest must follow it exactly, and one
linear scan reads at most ``MAX_INCONSISTENT_VALUES`` values (each string decoded on its own,
nested containers kept as their cut source text), counting the rest. Anything else is not a
consensus error: the caller reads the answer as a failure (pure).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from exporter.protocol.strings import bound_text

#: The longest message read as a consensus error (characters). One value per engine behind one
#: API server: 1,024 engines with 64-character values fit; anything longer is a failure.
MAX_CONSENSUS_MESSAGE = 128 * 1024
#: Values of one inconsistent answer kept (one per engine of that API server); the rest are
#: summed up in one last marker value.
MAX_INCONSISTENT_VALUES = 1024
#: How deep a nested value (a tuple, a map) may nest before the message is refused.
MAX_VALUE_DEPTH = 32

PYTHON_MARKER = "Engines returned different "
RUST_MARKER = "utility call `"
_WORDS: dict[bool, dict[str, Any]] = {
    True: {"True": True, "False": False, "None": None, "nan": float("nan"), "inf": float("inf")},
    False: {"true": True, "false": False, "null": None},
}
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_OPEN = {"[": "]", "(": ")", "{": "}"}


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
    JSON values; None for anything else."""
    if not text.startswith("[", start):
        return None
    at, more = _skip_space(text, start + 1), 0
    kept: list[Any] = []
    if text.startswith("]", at):
        return () if at + 1 == len(text) else None
    while True:
        read = _value(text, at, python)
        if read is None:
            return None
        value, at = read
        if len(kept) < MAX_INCONSISTENT_VALUES:
            kept.append(value)
        else:
            more += 1
        at = _skip_space(text, at)
        if text.startswith("]", at):
            break
        if not text.startswith(",", at):
            return None
        at = _skip_space(text, at + 1)
    if at + 1 != len(text):
        return None
    if more:
        kept.append(f"…[cut: {more} more values]")
    return tuple(kept)


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _value(text: str, at: int, python: bool) -> tuple[Any, int] | None:
    """One value at ``at`` and where it ends."""
    if at >= len(text):
        return None
    first = text[at]
    if first == '"' or (python and first == "'"):
        return _string(text, at, python)
    if python and first == "b" and text.startswith(("b'", 'b"'), at):  # bytes: its repr
        end = _string_end(text, at + 1)
        return None if end is None else (bound_text(text[at:end]), end)
    if first in _OPEN:
        end = _container_end(text, at, python)
        return None if end is None else (bound_text(text[at:end]), end)
    end = at
    while end < len(text) and (text[end].isalnum() or text[end] in _NUMBER_CHARS):
        end += 1
    token = text[at:end]
    if token in _WORDS[python]:
        return _WORDS[python][token], end
    if python and token == "-inf":
        return float("-inf"), end
    return _number(token, end)


def _number(token: str, end: int) -> tuple[Any, int] | None:
    if not token or not all(c in _NUMBER_CHARS for c in token) or len(token) > 64:
        return None
    try:
        return int(token), end
    except ValueError:
        pass
    try:
        return float(token), end
    except ValueError:
        return None


def _string_end(text: str, at: int) -> int | None:
    """The index after the string literal opening at ``at`` (escapes skipped)."""
    quote, i = text[at], at + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == quote:
            return i + 1
        i += 1
    return None


def _string(text: str, at: int, python: bool) -> tuple[Any, int] | None:
    end = _string_end(text, at)
    if end is None:
        return None
    literal = text[at:end]
    try:  # one literal, at most the message's length: linear
        value = ast.literal_eval(literal) if python else json.loads(literal)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return (bound_text(value), end) if isinstance(value, str) else None


def _container_end(text: str, at: int, python: bool) -> int | None:
    """The index after the container opening at ``at``: brackets matched, strings skipped,
    at most ``MAX_VALUE_DEPTH`` deep (the value is kept as its cut source text)."""
    closing = [_OPEN[text[at]]]
    i = at + 1
    while i < len(text):
        c = text[i]
        if c == '"' or (python and c == "'"):
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in _OPEN:
            if len(closing) >= MAX_VALUE_DEPTH:
                return None
            closing.append(_OPEN[c])
        elif c in ")]}":
            if c != closing.pop():
                return None
            if not closing:
                return i + 1
        i += 1
    return None
