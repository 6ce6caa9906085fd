"""Pure: the dev or RL route of vLLM's API server that stands for one utility call (HTTP mode,
``docs/protocol.md`` F.4; the mapping table is ``exporter.client.http``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.error import MethodNotAllowed

Query = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP request standing for one utility call."""

    verb: str
    path: str
    query: Query | None = None
    body: dict[str, Any] | None = None  # sent as JSON


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _no_args(method: str, args: tuple[Any, ...]) -> None:
    if args:
        raise MethodNotAllowed(f"{method} takes no arguments")


def route(method: str, args: tuple[Any, ...] = ()) -> Route:
    """Pure: the request for one utility call (``MethodNotAllowed`` for a method without a
    route or arguments the route cannot carry)."""
    if method == "is_sleeping":
        _no_args(method, args)
        return Route("GET", "/is_sleeping")
    if method == "is_scheduler_paused":
        _no_args(method, args)
        return Route("GET", "/is_paused")
    if method == "get_weight_version":
        _no_args(method, args)
        return Route("GET", "/weight_info")
    if method == "reset_prefix_cache":
        if len(args) > 2 or not all(isinstance(a, bool) for a in args):
            raise MethodNotAllowed("reset_prefix_cache takes at most two booleans")
        running = args[0] if args else False
        external = args[1] if len(args) > 1 else False
        query = [("reset_running_requests", _bool(running)), ("reset_external", _bool(external))]
        return Route("POST", "/reset_prefix_cache", query)
    if method in ("reset_mm_cache", "reset_encoder_cache", "resume_scheduler"):
        _no_args(method, args)
        path = "/resume" if method == "resume_scheduler" else f"/{method}"
        return Route("POST", path)
    if method == "sleep":
        if len(args) > 2:
            raise MethodNotAllowed("sleep takes (level[, mode])")
        level = args[0] if args else 1
        if isinstance(level, bool) or not isinstance(level, int):
            raise MethodNotAllowed("sleep's level must be an integer")
        query = [("level", str(level))]
        if len(args) > 1:
            query.append(("mode", _mode(args[1])))
        return Route("POST", "/sleep", query)
    if method == "wake_up":
        if len(args) > 1:
            raise MethodNotAllowed("wake_up takes ([tags])")
        tags = args[0] if args else None
        if tags is None:
            return Route("POST", "/wake_up")
        if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
            raise MethodNotAllowed("wake_up's tags must be a list of strings")
        return Route("POST", "/wake_up", [("tags", t) for t in tags])
    if method == "pause_scheduler":
        if len(args) > 2:
            raise MethodNotAllowed("pause_scheduler takes ([mode[, clear_cache]])")
        query = [("mode", _mode(args[0] if args else "abort"))]
        if len(args) > 1:
            if not isinstance(args[1], bool):
                raise MethodNotAllowed("pause_scheduler's clear_cache must be a boolean")
            query.append(("clear_cache", _bool(args[1])))
        return Route("POST", "/pause", query)
    if method == "set_weight_version":
        if len(args) != 1 or not isinstance(args[0], str):
            raise MethodNotAllowed("set_weight_version takes one string")
        return Route("POST", "/update_weight_version", body={"new_version": args[0]})
    if method == "compute_weight_checksums":
        _no_args(method, args)
        return Route("POST", "/weight_checker", body={"action": "checksum"})
    raise MethodNotAllowed(f"utility method {method!r} has no HTTP route")


def _mode(mode: Any) -> str:
    if not isinstance(mode, str):
        raise MethodNotAllowed("the pause mode must be a string")
    return mode
