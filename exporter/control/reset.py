"""The prefix-cache reset's request parsing and answer (pure): its query flags, the
``reset_external`` alias of vLLM's route, and the answer shape scripts already rely on."""

from __future__ import annotations

from typing import Any

from exporter.control.actions import ActionRequest, BadRequest, engine_id
from exporter.fleetstate.aggregate import AllTrueVerdict
from exporter.protocol import reset_args


def parse_bool(name: str, raw: str) -> bool:
    """true/false/1/0 (any case) and nothing else."""
    lowered = raw.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise BadRequest(f"query parameter {name!r} must be true, false, 1 or 0, got {raw!r}")


def parse_reset_flags(query: dict[str, list[str]]) -> dict[str, bool]:
    """Pure parsing of the reset's query parameters (``reset_external`` aliases the connector)."""
    allowed = {"reset_running_requests", "reset_connector", "reset_external"}
    for name, values in query.items():
        if name not in allowed:
            raise BadRequest(f"unknown query parameter {name!r}")
        if len(values) != 1:
            raise BadRequest(f"query parameter {name!r} given more than once")
    flags = {k: parse_bool(k, v[0]) for k, v in query.items()}
    connector = flags.get("reset_connector")
    external = flags.get("reset_external")
    if connector is not None and external is not None and connector != external:
        raise BadRequest("reset_connector and its alias reset_external disagree")
    return {
        "reset_running_requests": flags.get("reset_running_requests", False),
        "reset_connector": bool(connector if connector is not None else external),
    }


def parse_reset(query: dict[str, list[str]], body: bytes) -> ActionRequest:
    flags = parse_reset_flags(query)
    args = reset_args(flags["reset_running_requests"], flags["reset_connector"])
    return ActionRequest("reset_prefix_cache", "reset_prefix_cache", args, flags, expect_true=True)


def reset_body(
    verdict: AllTrueVerdict, flags: dict[str, bool], duration_s: float
) -> dict[str, Any]:
    failures = {f.engine: f for f in verdict.failures}
    engines = []
    for o in verdict.engines:
        f = failures.get(o.engine)
        engines.append(
            {
                "engine": engine_id(o.engine),
                "ok": f is None,
                "reason": f.reason if f else None,
                "error": f.error if f else None,
            }
        )
    return {
        "success": verdict.success,
        "outcome": verdict.outcome,
        "engines": engines,
        "failed_engines": [engine_id(f.engine) for f in verdict.failures],
        "flags": flags,
        "duration_s": round(duration_s, 6),
    }
