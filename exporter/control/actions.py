"""Collective admin actions: what each one sends, how it is checked, and its verdict (pure).

Every action is a fan-out of one utility method to every engine, then (where the engine exposes
the state) a read-back of that state on every engine: "the engine returned" is not "the engine
is in that state". ``classify`` turns both fan-outs into one verdict with a reason per engine;
``run_action`` is the thin I/O edge over a ``FleetClient``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fleet import EngineOutcome, FleetClient, Outcome
from exporter.fleetstate.aggregate import fleet_outcome
from exporter.fleetstate.checksums import ChecksumShapeError, compare, comparison_json, flatten
from exporter.fleetstate.invariants import (
    PAUSED,
    SLEEPING,
    WEIGHT_VERSION,
    Invariant,
    is_unsupported,
)
from exporter.protocol.strings import bound_text

PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache")
MAX_WEIGHT_VERSION = 256
#: Reasons an engine did not confirm an action, in the order they are checked.
REASONS = (
    "refused",
    "failed",
    "timeout",
    "disconnected",
    "unsupported",
    "unverified",
    "mismatch",
)


class BadRequest(Exception):
    """A malformed admin request; the message names the parameter."""


@dataclass(frozen=True, slots=True)
class Check:
    """Read ``invariant`` back on every engine after the call; it must equal ``expected``."""

    invariant: Invariant
    expected: Any


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

    @property
    def fingerprint(self) -> tuple[Any, ...]:
        """Identity of the request for Idempotency-Key reuse (action and parameters)."""
        return (self.action, json.dumps(dict(self.params), sort_keys=True))


Query = Mapping[str, list[str]]
Parser = Callable[[Query, bytes], ActionRequest]


def _single(query: Query, allowed: set[str]) -> dict[str, str]:
    for name, values in query.items():
        if name not in allowed:
            raise BadRequest(f"unknown query parameter {name!r}")
        if len(values) != 1:
            raise BadRequest(f"query parameter {name!r} given more than once")
    return {k: v[0] for k, v in query.items()}


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    if raw not in choices:
        raise BadRequest(f"query parameter {name!r} must be one of {', '.join(choices)}")
    return raw


def _no_body(body: bytes, action: str) -> None:
    if body.strip():
        raise BadRequest(f"{action} takes no request body (parameters go in the query)")


def parse_sleep(query: Query, body: bytes) -> ActionRequest:
    q = _single(query, {"level", "mode"})
    _no_body(body, "sleep")
    level = int(_choice("level", q.get("level", "1"), ("0", "1", "2")))
    mode = _choice("mode", q["mode"], PAUSE_MODES) if "mode" in q else None
    # (level,) works on every vLLM since sleep levels exist; the mode only when asked for.
    args: tuple[Any, ...] = (level,) if mode is None else (level, mode)
    params = {"level": level, "mode": mode or "abort"}
    return ActionRequest("sleep", "sleep", args, params, Check(SLEEPING, True))


def parse_wake_up(query: Query, body: bytes) -> ActionRequest:
    for name in query:
        if name != "tags":
            raise BadRequest(f"unknown query parameter {name!r}")
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
    q = _single(query, {"mode"})
    _no_body(body, "pause")
    mode = _choice("mode", q.get("mode", "abort"), PAUSE_MODES)
    return ActionRequest("pause", "pause_scheduler", (mode,), {"mode": mode}, Check(PAUSED, True))


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
        raise BadRequest('the body must be JSON: {"weight_version": "..."}') from None
    version = data.get("weight_version") if isinstance(data, dict) else None
    if not isinstance(version, str) or not 0 < len(version) <= MAX_WEIGHT_VERSION:
        raise BadRequest(
            f'the body must be {{"weight_version": "..."}} with 1-{MAX_WEIGHT_VERSION} characters'
        )
    if not _is_text(version):
        raise BadRequest("weight_version must be Unicode text (a lone surrogate escape is not)")
    if set(data) != {"weight_version"}:
        raise BadRequest("the body takes only weight_version")
    return ActionRequest(
        "weight_version",
        "set_weight_version",
        (version,),
        {"weight_version": version},
        Check(WEIGHT_VERSION, version),
    )


def _plain(action: str, method: str) -> Parser:
    def parse(query: Query, body: bytes) -> ActionRequest:
        _single(query, set())
        _no_body(body, action)
        return ActionRequest(action, method, (), {})

    return parse


@dataclass(frozen=True, slots=True)
class ActionSpec:
    name: str
    parse: Parser
    #: Changes engine state a stock front end tracks (refused in relay mode unless allowed).
    state_changing: bool = True


ACTIONS: dict[str, ActionSpec] = {
    spec.name: spec
    for spec in (
        ActionSpec("sleep", parse_sleep),
        ActionSpec("wake_up", parse_wake_up),
        ActionSpec("pause", parse_pause),
        ActionSpec("resume", parse_resume),
        ActionSpec("weight_version", parse_weight_version),
        ActionSpec("reset_mm_cache", _plain("reset_mm_cache", "reset_mm_cache"), False),
        ActionSpec(
            "reset_encoder_cache", _plain("reset_encoder_cache", "reset_encoder_cache"), False
        ),
        ActionSpec("verify_weights", _plain("verify_weights", "compute_weight_checksums"), False),
    )
}


# -- verdicts ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineResult:
    engine: str
    reason: str | None  # None: confirmed
    error: str | None = None
    #: The state read back afterwards (None: not read back or unknown).
    state: Any = None


@dataclass(frozen=True, slots=True)
class ActionVerdict:
    action: str
    engines: tuple[EngineResult, ...]
    verified: bool  # a read-back was part of the check

    @property
    def failures(self) -> tuple[EngineResult, ...]:
        return tuple(e for e in self.engines if e.reason is not None)

    @property
    def success(self) -> bool:
        return bool(self.engines) and not self.failures

    @property
    def outcome(self) -> str:
        return fleet_outcome(len(self.engines), len(self.failures))


def call_reason(outcome: EngineOutcome, expect_true: bool) -> tuple[str | None, str | None]:
    """Why one engine's call did not succeed (reason, error); (None, None) when it did."""
    if outcome.outcome is Outcome.OK:
        if expect_true and outcome.value is not True:
            if outcome.value is False:
                return "refused", None
            return "failed", bound_text(f"unexpected result {outcome.value!r}")
        return None, None
    if outcome.outcome is Outcome.TIMEOUT:
        return "timeout", outcome.error
    if outcome.outcome is Outcome.DISCONNECTED:
        return "disconnected", outcome.error
    if is_unsupported(outcome):
        return "unsupported", outcome.error
    return "failed", outcome.error


def classify(
    request: ActionRequest,
    calls: list[EngineOutcome],
    readback: Mapping[str, EngineOutcome] | None = None,
) -> ActionVerdict:
    """Pure: the call's outcomes and (when the action has a check) the state read back."""
    results = []
    check = request.check
    for o in calls:
        reason, error = call_reason(o, request.expect_true)
        state = None
        if check is not None and readback is not None:
            back = readback.get(o.engine)
            known = back is not None and back.ok and check.invariant.valid(back.value)
            state = back.value if known and back is not None else None
            if reason is None:
                if not known:
                    why = back.error if back is not None else "not read back"
                    reason, error = "unverified", f"could not read {check.invariant.method}: {why}"
                elif state != check.expected:
                    reason = "unverified"
                    error = (
                        f"accepted, but {check.invariant.method} is {state!r}, "
                        f"not {check.expected!r}"
                    )
        results.append(EngineResult(o.engine, reason, error, state))
    return ActionVerdict(request.action, tuple(results), verified=check is not None)


@dataclass(frozen=True, slots=True)
class ActionResult:
    status: int
    body: dict[str, Any]
    verdict: ActionVerdict | None = None
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def engine_id(label: str) -> int | str:
    """Engine indices as numbers (the HTTP contract), HTTP target names as strings."""
    return int(label) if label.isdigit() else label


def no_engine_body(action: str, params: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "action": action,
        "success": False,
        "outcome": "failure",
        "engines": [],
        "failed_engines": [],
        "params": dict(params),
        "error": "no engine is connected",
    }


def verdict_body(
    verdict: ActionVerdict, params: Mapping[str, Any], duration_s: float
) -> dict[str, Any]:
    engines = []
    for e in verdict.engines:
        entry: dict[str, Any] = {
            "engine": engine_id(e.engine),
            "ok": e.reason is None,
            "reason": e.reason,
            "error": e.error,
        }
        if verdict.verified:
            entry["state"] = e.state
        engines.append(entry)
    return {
        "action": verdict.action,
        "success": verdict.success,
        "outcome": verdict.outcome,
        "verified": verdict.verified,
        "engines": engines,
        "failed_engines": [engine_id(e.engine) for e in verdict.failures],
        "params": dict(params),
        "duration_s": round(duration_s, 6),
    }


async def run_action(
    client: FleetClient, request: ActionRequest, *, timeout_s: float
) -> ActionResult:
    """The call on every engine, then the read-back on every engine the call reached."""
    started = time.perf_counter()
    calls = await client.call_utility(request.method, request.args, timeout_s=timeout_s)
    if all(o.outcome is Outcome.DISCONNECTED for o in calls):
        return ActionResult(503, no_engine_body(request.action, request.params))
    readback = None
    if request.check is not None:
        reached = [o.engine for o in calls if o.outcome is not Outcome.DISCONNECTED]
        back = await client.call_utility(
            request.check.invariant.method, timeout_s=timeout_s, engines=reached
        )
        readback = {o.engine: o for o in back}
    verdict = classify(request, calls, readback)
    duration = time.perf_counter() - started
    status = 200 if verdict.success else 502
    return ActionResult(status, verdict_body(verdict, request.params, duration), verdict, duration)


async def run_verify_weights(client: FleetClient, *, timeout_s: float) -> ActionResult:
    """``compute_weight_checksums`` on every engine, compared across DP ranks
    (``exporter.fleetstate.checksums``): an engine that disagrees with the majority fails as
    ``mismatch``."""
    started = time.perf_counter()
    request = ActionRequest("verify_weights", "compute_weight_checksums", (), {})
    calls = await client.call_utility(request.method, timeout_s=timeout_s)
    if all(o.outcome is Outcome.DISCONNECTED for o in calls):
        return ActionResult(503, no_engine_body(request.action, {}))
    flat: dict[str, dict[str, str]] = {}
    results: dict[str, EngineResult] = {}
    for o in calls:
        reason, error = call_reason(o, expect_true=False)
        if reason is None:
            try:
                flat[o.engine] = flatten(o.value)
            except ChecksumShapeError as exc:
                reason, error = "failed", str(exc)
        if reason is not None:
            results[o.engine] = EngineResult(o.engine, reason, error)
    comparisons = {c.engine: c for c in compare(flat)}
    for engine, c in comparisons.items():
        reason = None if c.agrees_with_majority else "mismatch"
        error = None if reason is None else f"{c.mismatches} parameters differ from the majority"
        results[engine] = EngineResult(engine, reason, error, c.mismatches)
    verdict = ActionVerdict(request.action, tuple(results[o.engine] for o in calls), False)
    duration = time.perf_counter() - started
    body = verdict_body(verdict, {}, duration)
    for entry, o in zip(body["engines"], calls, strict=True):
        found = comparisons.get(o.engine)
        if found is not None:
            entry.update(comparison_json([found])[0], engine=engine_id(o.engine))
    status = 200 if verdict.success else 502
    return ActionResult(
        status,
        body,
        verdict,
        duration,
        {"mismatches": {e: c.mismatches for e, c in comparisons.items()}},
    )
