"""Verdicts of admin actions and their answers (pure: outcomes in, verdict and JSON body out).

"The engine returned" is not "the engine is in that state": ``classify`` turns an action's
fan-out and (where the engine exposes the state) its read-back into one verdict with a reason
per engine; ``classify_checksums`` compares ``verify_weights``' checksums across DP ranks. The
answer's keys follow the action's ``AnswerShape``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.parsing import ActionRequest
from exporter.fleetstate.aggregate import fleet_outcome
from exporter.fleetstate.checksums import (
    ChecksumShapeError,
    EngineComparison,
    compare,
    comparison_json,
    flatten,
)
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.activity import RequestCounts, counts_text
from exporter.protocol.strings import ascii_digits, bound_text

#: Engine → its ``has_work`` read back and its published counts (None: unknown), for an action
#: that must leave every engine drained (``ActionRequest.check_drained``).
DrainReadback = Mapping[str, tuple[EngineOutcome, RequestCounts | None]]

#: The status of an answer for something no engine supports (an action, a gate condition).
UNSUPPORTED_STATUS = 501


@dataclass(frozen=True, slots=True)
class EngineVerdict:
    """One engine's part in an action's verdict: confirmed (``reason`` None) or why not."""

    engine: str
    reason: str | None  # None: confirmed
    error: str | None = None
    #: The state read back afterwards (None: not read back or unknown).
    state: Any = None


@dataclass(frozen=True, slots=True)
class ActionVerdict:
    action: str
    engines: tuple[EngineVerdict, ...]
    verified: bool  # a read-back was part of the check

    @property
    def failures(self) -> tuple[EngineVerdict, ...]:
        return tuple(e for e in self.engines if e.reason is not None)

    @property
    def success(self) -> bool:
        return bool(self.engines) and not self.failures

    @property
    def outcome(self) -> str:
        unsupported = sum(1 for e in self.engines if e.reason == "unsupported")
        return fleet_outcome(len(self.engines), len(self.failures), unsupported)

    @property
    def status(self) -> int:
        """The HTTP status of the answer: 200 every engine confirmed, 501 no engine has the
        method (nothing to retry: that vLLM cannot do it), 502 anything else."""
        if self.success:
            return 200
        return UNSUPPORTED_STATUS if self.outcome == "unsupported" else 502


def call_reason(
    outcome: EngineOutcome, expect_true: bool, expect_none: bool = False
) -> tuple[str | None, str | None]:
    """Why one engine's call did not succeed (reason, error); (None, None) when it did."""
    if outcome.outcome is Outcome.OK and expect_none and outcome.value is not None:
        value = outcome.value
        text = value if isinstance(value, str) else f"unexpected result {value!r}"
        return "refused", bound_text(text)
    if outcome.outcome is Outcome.OK:
        if expect_true and outcome.value is not True:
            if outcome.value is False:
                return "refused", None
            # Strings in the value are cut already; a long list of numbers is not.
            return "failed", bound_text(f"unexpected result {outcome.value!r}")
        return None, None
    if outcome.outcome is Outcome.TIMEOUT:
        return "timeout", outcome.error
    if outcome.outcome is Outcome.DISCONNECTED:
        return "disconnected", outcome.error
    if is_unsupported(outcome):
        return "unsupported", outcome.error
    return "failed", outcome.error


def drain_failure(back: tuple[EngineOutcome, RequestCounts | None] | None) -> str | None:
    """Why one engine is not known to be drained after an action that waits for it (None:
    ``has_work`` answered false and no published count is above zero)."""
    if back is None:
        return "could not read has_work: not read back"
    o, counts = back
    if not o.ok:
        return f"could not read has_work: {o.error or o.outcome.value}"
    said = counts_text(counts)
    if o.value is not False:
        return f"paused, but it still has work{said}"
    if counts is not None and counts.total:
        return f"paused, has_work is false but vLLM publishes requests{said}"
    return None


def classify(
    request: ActionRequest,
    calls: Sequence[EngineOutcome],
    readback: Mapping[str, EngineOutcome] | None = None,
    drain: DrainReadback | None = None,
) -> ActionVerdict:
    """The call's outcomes and (when the action has a check) the state read back, and the
    work left on each engine for an action that must leave them drained."""
    results = []
    check = request.check
    for o in calls:
        reason, error = call_reason(o, request.expect_true, request.expect_none)
        state = None
        if check is not None and readback is not None:
            back = readback.get(o.engine)
            known = back is not None and back.ok and check.invariant.valid(back.value)
            state = back.value if known and back is not None else None
            if reason is None:
                if not known:
                    why = (
                        "not read back"
                        if back is None
                        else back.error or f"answered {bound_text(repr(back.value), 64)}"
                    )
                    reason, error = "unverified", f"could not read {check.invariant.method}: {why}"
                elif not check.holds(state):
                    reason = "unverified"
                    error = (
                        f"accepted, but {check.invariant.method} is {state!r}, not {check.wanted()}"
                    )
            if reason is None and request.check_drained and drain is not None:
                left = drain_failure(drain.get(o.engine))
                if left is not None:
                    reason, error = "unverified", left
        results.append(EngineVerdict(o.engine, reason, error, state))
    return ActionVerdict(request.action, tuple(results), verified=check is not None)


def classify_checksums(
    action: str, calls: Sequence[EngineOutcome]
) -> tuple[ActionVerdict, dict[str, EngineComparison]]:
    """``compute_weight_checksums`` of every engine compared across DP ranks
    (``exporter.fleetstate.checksums``): an engine that disagrees with the majority fails as
    ``mismatch``; one that agrees but had nothing to compare (no checksums, or only digests of
    empty input, which cannot tell two weights apart) as ``unverified``, so a verification
    that verified nothing is no success. Also returns each compared engine's comparison."""
    flat: dict[str, dict[str, str]] = {}
    results: dict[str, EngineVerdict] = {}
    for o in calls:
        reason, error = call_reason(o, expect_true=False)
        if reason is None:
            try:
                flat[o.engine] = flatten(o.value)
            except ChecksumShapeError as exc:
                reason, error = "failed", str(exc)
        if reason is not None:
            results[o.engine] = EngineVerdict(o.engine, reason, error)
    comparisons = {c.engine: c for c in compare(flat)}
    for engine, c in comparisons.items():
        reason, error = None, None
        if not c.agrees_with_majority:
            reason, error = "mismatch", f"{c.mismatches} parameters differ from the majority"
        elif c.compared == 0:
            reason, error = "unverified", nothing_compared(c)
        results[engine] = EngineVerdict(engine, reason, error, c.mismatches)
    verdict = ActionVerdict(action, tuple(results[o.engine] for o in calls), False)
    return verdict, comparisons


def nothing_compared(c: EngineComparison) -> str:
    """Why an engine that agrees verified nothing."""
    if c.parameters == 0:
        return "no parameter could be compared: the engine returned no checksums"
    return (
        f"no parameter could be compared: all {c.parameters} checksums are the digest of "
        "empty input, which cannot tell two weights apart"
    )


# -- answers -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AnswerShape:
    """The keys of an action's answer. The prefix-cache reset's answer predates the other
    actions and scripts read it as it is: it names neither the action nor whether a read-back
    ran, and calls its parameters ``flags`` (its audit record too)."""

    params_key: str = "params"
    #: ``action`` and ``verified`` keys in the answer.
    self_describing: bool = True


ACTION_ANSWER = AnswerShape()
RESET_ANSWER = AnswerShape(params_key="flags", self_describing=False)
NO_ENGINE = "no engine is connected"


def engine_id(label: str) -> int | str:
    """Engine indices as numbers (the HTTP contract), HTTP target names as strings."""
    return int(label) if ascii_digits(label) else label


def no_engine_body(
    action: str, params: Mapping[str, Any], shape: AnswerShape = ACTION_ANSWER
) -> dict[str, Any]:
    """The 503 answer: no engine was connected, nothing was sent."""
    body: dict[str, Any] = {"action": action} if shape.self_describing else {}
    body.update(success=False, outcome="failure", engines=[], failed_engines=[])
    body[shape.params_key] = dict(params)
    body["error"] = NO_ENGINE
    return body


def verdict_body(
    verdict: ActionVerdict,
    params: Mapping[str, Any],
    duration_s: float,
    shape: AnswerShape = ACTION_ANSWER,
) -> dict[str, Any]:
    """The 200/502 answer: the verdict per engine."""
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
    body: dict[str, Any] = {"action": verdict.action} if shape.self_describing else {}
    body.update(success=verdict.success, outcome=verdict.outcome)
    if shape.self_describing:
        body["verified"] = verdict.verified
    body.update(engines=engines, failed_engines=[engine_id(e.engine) for e in verdict.failures])
    body[shape.params_key] = dict(params)
    body["duration_s"] = round(duration_s, 6)
    return body


def add_comparisons(
    body: dict[str, Any], verdict: ActionVerdict, comparisons: Mapping[str, EngineComparison]
) -> None:
    """``verify_weights``' answer (``verdict_body`` of ``verdict``): each compared engine's
    entry also carries its comparison (``parameters``, ``compared``, ``mismatches``,
    ``unverifiable`` and the parameters behind the last two)."""
    for entry, e in zip(body["engines"], verdict.engines, strict=True):
        found = comparisons.get(e.engine)
        if found is not None:
            entry.update(comparison_json([found])[0], engine=engine_id(e.engine))
