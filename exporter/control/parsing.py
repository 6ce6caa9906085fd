"""Admin requests, parsed (pure): what each action's query and body may say, and the utility
call, canonical parameters and read-back they turn into.

A parser raises ``BadActionRequest`` naming the parameter; the admin listener answers it with a 400
before anything reaches an engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.fleetstate.invariants import CHECKPOINT, PAUSED, SLEEPING, WEIGHT_VERSION, Invariant
from exporter.protocol.checkpoint import PREPARED, PREPARING, RESTORING, RUNNING
from exporter.protocol.utility import PAUSE_MODES, reset_args

WAKE_TAGS = ("weights", "kv_cache")
MAX_WEIGHT_VERSION = 256


class BadActionRequest(Exception):
    """A malformed admin request; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class Check:
    """Read ``invariant`` back on every engine after the call; its state (``state_of``) must
    equal ``expected``, or be one of them when ``expected`` is a frozenset."""

    invariant: Invariant
    expected: Any

    def holds(self, value: Any) -> bool:
        seen = self.invariant.state_of(value)
        if isinstance(self.expected, frozenset):
            return seen in self.expected
        return bool(seen == self.expected)

    def wanted(self) -> str:
        """What ``expected`` is, as the unverified text names it."""
        if isinstance(self.expected, frozenset):
            return " or ".join(repr(v) for v in sorted(self.expected))
        return repr(self.expected)


@dataclass(frozen=True, slots=True)
class ActionRequest:
    """One parsed request: the utility call, its canonical parameters, its verification."""

    action: str
    method: str
    args: tuple[Any, ...]
    params: Mapping[str, Any]
    check: Check | None = None
    #: The engine's own answer must be ``True`` (``reset_prefix_cache``).
    expect_true: bool = False
    #: The engine's own answer must be None: a string is its refusal, nothing changed
    #: (vLLM 0.34's ``checkpoint_prepare``).
    expect_none: bool = False
    #: Also read ``has_work`` back: it must be false (mode ``wait``: the pause answered once
    #: in-flight work finished, so work left is a request admitted meanwhile or a pause that
    #: returned early).
    check_drained: bool = False

    @property
    def fingerprint(self) -> tuple[Any, ...]:
        """Identity of the request for Idempotency-Key reuse (action and parameters)."""
        return (self.action, json.dumps(dict(self.params), sort_keys=True))


Query = Mapping[str, list[str]]
Parser = Callable[[Query, bytes], ActionRequest]


def _single(query: Query, allowed: set[str]) -> dict[str, str]:
    for name, values in query.items():
        if name not in allowed:
            raise BadActionRequest(f"unknown query parameter {name!r}")
        if len(values) != 1:
            raise BadActionRequest(f"query parameter {name!r} given more than once")
    return {k: v[0] for k, v in query.items()}


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise BadActionRequest(f"query parameter {name!r} must be one of {', '.join(choices)}")
    return raw


def _no_body(body: bytes, action: str) -> None:
    if body.strip():
        raise BadActionRequest(f"{action} takes no request body (parameters go in the query)")


def parse_sleep(query: Query, body: bytes) -> ActionRequest:
    q = _single(query, {"level", "mode"})
    _no_body(body, "sleep")
    level = int(_choice("level", q.get("level", "1"), ("0", "1", "2")))
    mode = _choice("mode", q["mode"], PAUSE_MODES) if "mode" in q else None
    # (level,) works on every vLLM since sleep levels exist; the mode only when asked for.
    args: tuple[Any, ...] = (level,) if mode is None else (level, mode)
    params = {"level": level, "mode": mode or "abort"}
    return ActionRequest(
        "sleep", "sleep", args, params, Check(SLEEPING, True), check_drained=mode == "wait"
    )


def parse_wake_up(query: Query, body: bytes) -> ActionRequest:
    for name in query:
        if name != "tags":
            raise BadActionRequest(f"unknown query parameter {name!r}")
    _no_body(body, "wake_up")
    tags: list[str] = []
    for raw in query.get("tags", []):
        for tag in raw.split(","):
            tags.append(_choice("tags", tag.strip(), WAKE_TAGS))
    unique = sorted(set(tags))
    if not unique:  # everything: afterwards every engine must be awake
        return ActionRequest("wake_up", "wake_up", (None,), {"tags": None}, Check(SLEEPING, False))
    # Every tag named wakes everything too (vLLM clears its sleeping tags, then is_sleeping is
    # false): the same read-back. The tags are still sent as asked.
    check = Check(SLEEPING, False) if set(unique) == set(WAKE_TAGS) else None
    return ActionRequest("wake_up", "wake_up", (unique,), {"tags": unique}, check)


def parse_pause(query: Query, body: bytes) -> ActionRequest:
    q = _single(query, {"mode", "clear_cache"})
    _no_body(body, "pause")
    mode = _choice("mode", q.get("mode", "abort"), PAUSE_MODES)
    # vLLM clears every cache once the pause completes (clear_cache, its default true), which
    # for mode keep preempts the running requests it keeps; clear_cache=false keeps them. The
    # argument is sent only when asked, as before.
    if "clear_cache" not in q:
        return _pause_request((mode,), {"mode": mode})
    clear_cache = parse_bool("clear_cache", q["clear_cache"])
    return _pause_request((mode, clear_cache), {"mode": mode, "clear_cache": clear_cache})


def _pause_request(args: tuple[Any, ...], params: dict[str, Any]) -> ActionRequest:
    return ActionRequest(
        "pause",
        "pause_scheduler",
        args,
        params,
        Check(PAUSED, True),
        check_drained=args[0] == "wait",
    )


def parse_resume(query: Query, body: bytes) -> ActionRequest:
    _single(query, set())
    _no_body(body, "resume")
    return ActionRequest("resume", "resume_scheduler", (), {}, Check(PAUSED, False))


def _is_text(value: str) -> bool:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no engine can be sent
    (msgpack strings are UTF-8)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_weight_version(query: Query, body: bytes) -> ActionRequest:
    _single(query, set())
    try:
        data = json.loads(body or b"null")
    except (ValueError, RecursionError):  # 1 KiB of "[" nests deeper than the decoder goes
        raise BadActionRequest('the body must be JSON: {"weight_version": "..."}') from None
    version = data.get("weight_version") if isinstance(data, dict) else None
    if not isinstance(version, str) or not 0 < len(version) <= MAX_WEIGHT_VERSION:
        raise BadActionRequest(
            f'the body must be {{"weight_version": "..."}} with 1-{MAX_WEIGHT_VERSION} characters'
        )
    if not _is_text(version):
        raise BadActionRequest(
            "weight_version must be Unicode text (a lone surrogate escape is not)"
        )
    if set(data) != {"weight_version"}:
        raise BadActionRequest("the body takes only weight_version")
    return ActionRequest(
        "weight_version",
        "set_weight_version",
        (version,),
        {"weight_version": version},
        Check(WEIGHT_VERSION, version),
    )


def parse_checkpoint_prepare(query: Query, body: bytes) -> ActionRequest:
    """vLLM 0.34's ``checkpoint_prepare(mode)``: drain with ``mode`` (vLLM's default ``wait``),
    then release what a process checkpoint must not hold. It answers once started: the
    read-back takes ``preparing`` or ``prepared`` (wait for ``GET /gate?checkpoint=prepared``)."""
    q = _single(query, {"mode"})
    _no_body(body, "checkpoint_prepare")
    mode = _choice("mode", q.get("mode", "wait"), PAUSE_MODES)
    return ActionRequest(
        "checkpoint_prepare",
        "checkpoint_prepare",
        (mode,),
        {"mode": mode},
        Check(CHECKPOINT, frozenset({PREPARING, PREPARED})),
        expect_none=True,
    )


def parse_checkpoint_restore(query: Query, body: bytes) -> ActionRequest:
    """vLLM 0.34's ``checkpoint_restore()``: bring back what preparing released and serve; the
    read-back takes ``restoring`` or ``running`` (a restore already done is a no-op)."""
    _single(query, set())
    _no_body(body, "checkpoint_restore")
    return ActionRequest(
        "checkpoint_restore",
        "checkpoint_restore",
        (),
        {},
        Check(CHECKPOINT, frozenset({RESTORING, RUNNING})),
    )


def plain(action: str, method: str) -> Parser:
    """The parser of an action without parameters: no query, no body."""

    def parse(query: Query, body: bytes) -> ActionRequest:
        _single(query, set())
        _no_body(body, action)
        return ActionRequest(action, method, (), {})

    return parse


# -- the prefix-cache reset: vLLM's route's flags, and the alias its HTTP route uses -----------


def parse_bool(name: str, raw: str) -> bool:
    """true/false/1/0 (any case) and nothing else."""
    lowered = raw.lower()
    if lowered in ("true", "1"):
        return True
    if lowered in ("false", "0"):
        return False
    raise BadActionRequest(f"query parameter {name!r} must be true, false, 1 or 0, got {raw!r}")


def parse_reset_flags(query: Query) -> dict[str, bool]:
    """The reset's query parameters (``reset_external`` aliases the connector)."""
    allowed = {"reset_running_requests", "reset_connector", "reset_external"}
    for name, values in query.items():
        if name not in allowed:
            raise BadActionRequest(f"unknown query parameter {name!r}")
        if len(values) != 1:
            raise BadActionRequest(f"query parameter {name!r} given more than once")
    flags = {k: parse_bool(k, v[0]) for k, v in query.items()}
    connector = flags.get("reset_connector")
    external = flags.get("reset_external")
    if connector is not None and external is not None and connector != external:
        raise BadActionRequest("reset_connector and its alias reset_external disagree")
    return {
        "reset_running_requests": flags.get("reset_running_requests", False),
        "reset_connector": bool(connector if connector is not None else external),
    }


def reset_request(reset_running_requests: bool, reset_connector: bool) -> ActionRequest:
    """``reset_prefix_cache`` with these flags; confirmed only by the engine's own ``True``
    (vLLM exposes no state to read back)."""
    flags = {
        "reset_running_requests": reset_running_requests,
        "reset_connector": reset_connector,
    }
    args = reset_args(reset_running_requests, reset_connector)
    return ActionRequest("reset_prefix_cache", "reset_prefix_cache", args, flags, expect_true=True)


def parse_reset(query: Query, body: bytes) -> ActionRequest:
    """The reset reads no body: any body up to the listener's bound is ignored, as documented."""
    flags = parse_reset_flags(query)
    return reset_request(flags["reset_running_requests"], flags["reset_connector"])
