"""Pure mapping of one vLLM dev-route reply to one ``EngineOutcome`` (protocol doc F.4.1).

An API server whose own engines disagree answers HTTP 500 "Engines returned different
is_sleeping results: [False, True]" (a Python list repr): that target becomes ``INCONSISTENT``
carrying those values. 404 on a dev route means dev mode is off; an empty 200 from a reset means
a vLLM older than 0.26 (which answered no ``success`` field).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from exporter.fleet import EngineOutcome, Outcome

DEV_MODE_OFF = "dev mode is off on this server (set VLLM_SERVER_DEV_MODE=1)"
NO_SUCCESS_FIELD = "server did not report success (vLLM older than 0.26?)"
_INCONSISTENT = re.compile(r"^Engines returned different (\w+) results: (\[.*\])\s*$", re.DOTALL)
_MAX_ERROR_CHARS = 500


def _clip(text: str) -> str:
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + "..."


def _error_message(body: bytes) -> str | None:
    """vLLM's error envelope ``{"error": {"message": ...}}`` or FastAPI's ``{"detail": ...}``."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        detail = data.get("detail")
        if detail is not None:
            return detail if isinstance(detail, str) else json.dumps(detail)
    return None


def parse_inconsistent(message: str, method: str) -> tuple[Any, ...] | None:
    """The values of vLLM's "Engines returned different <method> results: [...]" message."""
    m = _INCONSISTENT.match(message.strip())
    if m is None or m.group(1) != method:
        return None
    try:
        values = ast.literal_eval(m.group(2))
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return tuple(values) if isinstance(values, list) else None


def interpret(
    label: str, method: str, status: int, body: bytes, duration_s: float | None
) -> EngineOutcome:
    """Pure: one HTTP reply of a dev route → one ``EngineOutcome`` (F.4.1)."""

    def failed(error: str) -> EngineOutcome:
        return EngineOutcome(label, Outcome.FAILED, error=_clip(error), duration_s=duration_s)

    if status == 404:
        return failed(DEV_MODE_OFF)
    message = _error_message(body)
    if status == 500 and message is not None:
        values = parse_inconsistent(message, method)
        if values is not None:
            return EngineOutcome(
                label,
                Outcome.INCONSISTENT,
                error=_clip(message),
                duration_s=duration_s,
                values=values,
            )
        return failed(message)
    if status != 200:
        return failed(f"HTTP {status}: {message if message is not None else _snippet(body)}")
    key = "is_sleeping" if method == "is_sleeping" else "success"
    if not body.strip():
        return failed(NO_SUCCESS_FIELD if key == "success" else "empty response body")
    try:
        data = json.loads(body)
    except ValueError:
        return failed(f"response is not JSON: {_snippet(body)}")
    if not isinstance(data, dict) or key not in data:
        if key == "success":
            return failed(NO_SUCCESS_FIELD)
        return failed(f"response has no {key!r}: {_snippet(body)}")
    return EngineOutcome(label, Outcome.OK, data[key], duration_s=duration_s)


def _snippet(body: bytes) -> str:
    return _clip(body.decode("utf-8", "replace").strip()) or "(empty body)"
