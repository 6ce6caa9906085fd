"""The admin actions as data: each one's parser, timeout, rate limit, answer shape and the
counters it moves, and the fan-outs that run them over a ``FleetClient``.

Every action is a fan-out of one utility method to every engine, then (where the engine exposes
the state) a read-back of that state on every engine; the verdicts are pure
(``exporter.control.verdicts``), the fan-outs here are the thin I/O edge, and
``exporter.control.runner`` runs a parsed request with its spec and records what happened.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from exporter.client.fleet import EngineOutcome, FleetClient, Outcome
from exporter.config.settings import ServeConfig
from exporter.control.parsing import (
    ActionRequest,
    Parser,
    parse_checkpoint_prepare,
    parse_checkpoint_restore,
    parse_pause,
    parse_reset,
    parse_resume,
    parse_sleep,
    parse_wake_up,
    parse_weight_version,
    plain,
)
from exporter.control.verdicts import (
    ACTION_ANSWER,
    RESET_ANSWER,
    ActionVerdict,
    AnswerShape,
    DrainReadback,
    add_comparisons,
    classify,
    classify_checksums,
    drain_failure,
    no_engine_body,
    verdict_body,
)
from exporter.fleetstate.invariants import HAS_WORK, require_type
from exporter.protocol.activity import RequestCounts


@dataclass(frozen=True, slots=True)
class ActionRun:
    """One run of an action: the HTTP status and body it answers, the verdict behind them."""

    status: int
    body: dict[str, Any]
    #: None: no engine was connected (503), nothing was sent.
    verdict: ActionVerdict | None = None
    duration_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Fanout(Protocol):
    """Runs one parsed request on every engine and answers it."""

    def __call__(
        self,
        client: FleetClient,
        request: ActionRequest,
        *,
        timeout_s: float,
        shape: AnswerShape = ACTION_ANSWER,
    ) -> Awaitable[ActionRun]: ...


#: Methods an engine can only run when it was started with ``--enable-sleep-mode``.
SLEEP_MODE_METHODS = frozenset({"sleep", "wake_up", "checkpoint_prepare", "checkpoint_restore"})
NO_SLEEP_MODE = (
    "unsupported by this engine: it registered without sleep mode (vllm serve "
    "--enable-sleep-mode); not sent"
)


def capability_gaps(client: FleetClient, method: str) -> dict[str, EngineOutcome]:
    """Engines whose registration says they cannot run ``method``: their outcome, without
    sending the call (pure over ``engine_details``). Where the registration does not say
    (an older vLLM, HTTP mode), the engine is asked as usual."""
    if method not in SLEEP_MODE_METHODS:
        return {}
    return {
        d.engine: EngineOutcome(d.engine, Outcome.FAILED, error=NO_SLEEP_MODE)
        for d in client.engine_details()
        if d.enable_sleep_mode is False
    }


async def call_capable(
    client: FleetClient, method: str, args: tuple[Any, ...], timeout_s: float
) -> tuple[list[EngineOutcome], frozenset[str]]:
    """``method`` on every engine that can run it, ``unsupported`` for the others (in the
    fleet's engine order), and the engines it was not sent to."""
    gaps = capability_gaps(client, method)
    if not gaps:
        return await client.call_utility(method, args, timeout_s=timeout_s), frozenset()
    labels = client.engine_labels
    capable = [label for label in labels if label not in gaps]
    asked = (
        await client.call_utility(method, args, timeout_s=timeout_s, engines=capable)
        if capable
        else []
    )
    by_engine = {o.engine: o for o in asked} | gaps
    return [by_engine[label] for label in labels if label in by_engine], frozenset(gaps)


#: How often an action that waits for a drain reads ``has_work`` again while work is left.
DRAIN_RECHECK_S = 0.2


async def read_back(
    client: FleetClient, request: ActionRequest, reached: list[str], timeout_s: float
) -> tuple[dict[str, EngineOutcome], DrainReadback | None]:
    """The state ``request.check`` reads on the engines the call ``reached`` and, for a
    ``check_drained`` action, each one's ``has_work`` with its published counts. Both are read
    at once; an engine that still has work is read again every ``DRAIN_RECHECK_S`` within
    ``timeout_s`` (vLLM's pause answers once its own requests finished, while a DP wave or a
    batch in flight may take a few steps more), so the answer comes once every rank drained,
    or says which did not."""
    if request.check is None or not reached:
        return {}, ({} if request.check_drained else None)
    deadline = time.monotonic() + timeout_s
    check = client.call_utility(
        request.check.invariant.method, timeout_s=timeout_s, engines=reached
    )
    if not request.check_drained:
        return {o.engine: o for o in await check}, None
    back, work = await asyncio.gather(check, _read_work(client, reached, timeout_s))
    while True:
        busy = [e for e, (o, counts) in work.items() if drain_failure((o, counts)) and o.ok]
        left = deadline - time.monotonic()
        if not busy or left <= DRAIN_RECHECK_S:
            break
        await asyncio.sleep(DRAIN_RECHECK_S)
        work |= await _read_work(client, busy, left - DRAIN_RECHECK_S)
    return {o.engine: o for o in back}, work


async def _read_work(
    client: FleetClient, engines: list[str], timeout_s: float
) -> dict[str, tuple[EngineOutcome, RequestCounts | None]]:
    """``has_work`` of ``engines`` (type-checked) with each one's published counts."""
    read = await client.call_utility(HAS_WORK.method, timeout_s=timeout_s, engines=engines)
    counts = {d.engine: d.requests for d in client.engine_details() if d.requests is not None}
    return {o.engine: (o, counts.get(o.engine)) for o in require_type(HAS_WORK, read)}


async def run_action(
    client: FleetClient,
    request: ActionRequest,
    *,
    timeout_s: float,
    shape: AnswerShape = ACTION_ANSWER,
) -> ActionRun:
    """The call on every engine, then the read-back on every engine the call reached."""
    started = time.perf_counter()
    calls, not_sent = await call_capable(client, request.method, request.args, timeout_s)
    if all(o.outcome is Outcome.DISCONNECTED for o in calls):
        return ActionRun(503, no_engine_body(request.action, request.params, shape))
    readback = drain = None
    if request.check is not None:
        reached = [
            o.engine
            for o in calls
            if o.outcome is not Outcome.DISCONNECTED and o.engine not in not_sent
        ]
        readback, drain = await read_back(client, request, reached, timeout_s)
    verdict = classify(request, calls, readback, drain)
    duration = time.perf_counter() - started
    body = verdict_body(verdict, request.params, duration, shape)
    return ActionRun(verdict.status, body, verdict, duration)


async def run_verify_weights(
    client: FleetClient,
    request: ActionRequest,
    *,
    timeout_s: float,
    shape: AnswerShape = ACTION_ANSWER,
) -> ActionRun:
    """``compute_weight_checksums`` on every engine, compared across DP ranks; ``extra``
    carries the mismatch count per engine that had something to compare (one whose checksums
    were all unverifiable is left out: "0 mismatches" would read as verified)."""
    started = time.perf_counter()
    calls = await client.call_utility(request.method, request.args, timeout_s=timeout_s)
    if all(o.outcome is Outcome.DISCONNECTED for o in calls):
        return ActionRun(503, no_engine_body(request.action, request.params, shape))
    verdict, comparisons = classify_checksums(request.action, calls)
    duration = time.perf_counter() - started
    body = verdict_body(verdict, request.params, duration, shape)
    add_comparisons(body, verdict, comparisons)
    mismatches = {e: c.mismatches for e, c in comparisons.items() if c.compared or c.mismatches}
    return ActionRun(verdict.status, body, verdict, duration, {"mismatches": mismatches})


@dataclass(frozen=True, slots=True)
class RateLimit:
    """At most one run every ``interval(config)`` seconds; sooner is a 429 with Retry-After."""

    interval: Callable[[ServeConfig], float]
    #: What the 429 says is limited: "{what} are limited to one every 1s".
    what: str

    def refusal(self, interval_s: float) -> str:
        return f"{self.what} are limited to one every {interval_s:g}s"


def action_timeout(config: ServeConfig) -> float:
    return config.action_timeout


def reset_timeout(config: ServeConfig) -> float:
    return config.reset_timeout or config.call_timeout


def verify_weights_timeout(config: ServeConfig) -> float:
    return config.verify_weights_timeout


def reset_min_interval(config: ServeConfig) -> float:
    return config.reset_min_interval


@dataclass(frozen=True, slots=True)
class ActionSpec:
    """One admin action (``POST /admin/<name>``)."""

    name: str
    parse: Parser
    #: Changes engine state a stock front end tracks (refused in relay mode unless allowed).
    state_changing: bool = True
    #: Seconds each engine has to answer the call (and, apart, the read-back).
    timeout: Callable[[ServeConfig], float] = action_timeout
    fanout: Fanout = run_action
    rate_limit: RateLimit | None = None
    answer: AnswerShape = ACTION_ANSWER
    #: Also counted in the ``vllm_dp_prefix_cache_reset*`` series.
    counts_as_reset: bool = False
    #: How the partial-failure warning names the action ("" → ``name``).
    log_name: str = ""
    #: More paths below ``/admin/`` that run it (vLLM's own route names).
    aliases: tuple[str, ...] = ()

    @property
    def paths(self) -> tuple[str, ...]:
        """Every path below ``/admin/`` that runs it: its name first."""
        return (self.name, *self.aliases)


ACTIONS: dict[str, ActionSpec] = {
    spec.name: spec
    for spec in (
        ActionSpec(
            "reset_prefix_cache",
            parse_reset,
            state_changing=False,
            timeout=reset_timeout,
            rate_limit=RateLimit(reset_min_interval, "resets"),
            answer=RESET_ANSWER,
            counts_as_reset=True,
            log_name="prefix-cache reset",
        ),
        ActionSpec("sleep", parse_sleep),
        ActionSpec("wake_up", parse_wake_up),
        ActionSpec("pause", parse_pause),
        ActionSpec("resume", parse_resume),
        ActionSpec("weight_version", parse_weight_version),
        ActionSpec("reset_mm_cache", plain("reset_mm_cache", "reset_mm_cache"), False),
        ActionSpec(
            "reset_encoder_cache", plain("reset_encoder_cache", "reset_encoder_cache"), False
        ),
        ActionSpec(
            "verify_weights",
            plain("verify_weights", "compute_weight_checksums"),
            state_changing=False,
            timeout=verify_weights_timeout,
            fanout=run_verify_weights,
        ),
        ActionSpec("checkpoint_prepare", parse_checkpoint_prepare, aliases=("checkpoint/prepare",)),
        ActionSpec("checkpoint_restore", parse_checkpoint_restore, aliases=("checkpoint/restore",)),
    )
}
