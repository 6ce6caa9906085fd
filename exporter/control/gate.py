"""``GET /gate``: the safe-to-resume check an RL loop runs before it resumes traffic.

Conditions come as query parameters (``weight_version=V``, ``sleeping=true|false``,
``paused=true|false``, ``healthy=true|false``: no rank reports a fault-tolerance status but
``healthy``; ``drained=true|false``: every rank answered ``has_work`` false and no published
request count says otherwise; ``inference_ready=true|false``: vLLM 0.34's
``is_inference_ready``, asked only by a gate that names it). The gate runs a **fresh** fan-out
(never the cached poll), shared by concurrent callers and at most one every ``min_interval_s``;
``evaluate`` is the pure verdict over that sample: 200 when every expected engine answered and
meets every condition, 412 naming the failing engines and conditions, 501 when no engine
supports a condition (an older vLLM: waiting cannot help), 503 when no engine is connected. Only
the read methods the conditions need are asked (every one without conditions).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fleet import EngineOutcome, FleetClient, Outcome, connected_count
from exporter.control.fleetread import ALL_METHODS as ALL_METHODS  # a bare gate asks these
from exporter.control.fleetread import FleetRead
from exporter.control.verdicts import UNSUPPORTED_STATUS
from exporter.fleetstate.invariants import (
    BY_KEY,
    CHECKPOINT,
    HAS_WORK,
    READS,
    SLEEPING,
    Invariant,
    is_unsupported,
)
from exporter.protocol.activity import RequestCounts, counts_text
from exporter.protocol.checkpoint import GATE_STATES
from exporter.protocol.pushes import FaultStatus


class GateRequestError(Exception):
    """A bad gate query; the message names the parameter."""


#: The condition on each engine's fault-tolerance status (not a polled invariant: it comes
#: from what the engines push, ``EngineDetail.fault_status``).
HEALTHY = "healthy"
#: The condition on each engine's work (``has_work`` false, no request running or waiting).
DRAINED = "drained"
#: Conditions that are not one invariant's value, and the read method each needs (None: none).
SPECIAL: dict[str, str | None] = {HEALTHY: None, DRAINED: HAS_WORK.method}


def parse_conditions(query: Mapping[str, list[str]]) -> dict[str, Any]:
    """``{key: expected value}`` from the query (pure)."""
    conditions: dict[str, Any] = {}
    for name, values in query.items():
        invariant = BY_KEY.get(name)
        if invariant is None and name not in SPECIAL:
            known = ", ".join((*BY_KEY, *SPECIAL))
            raise GateRequestError(f"unknown condition {name!r} (known: {known})")
        if len(values) != 1:
            raise GateRequestError(f"condition {name!r} given more than once")
        raw = values[0]
        if invariant is None or invariant.expected == "a boolean":
            lowered = raw.lower()
            if lowered not in ("true", "false", "1", "0"):
                raise GateRequestError(
                    f"condition {name!r} must be true, false, 1 or 0, got {raw!r}"
                )
            conditions[name] = lowered in ("true", "1")
        elif invariant is CHECKPOINT:
            if raw not in GATE_STATES:
                raise GateRequestError(
                    f"condition {name!r} must be {' or '.join(GATE_STATES)}, got {raw[:64]!r}"
                )
            conditions[name] = raw
        else:
            if not raw or len(raw) > 256:
                raise GateRequestError(f"condition {name!r} must be 1-256 characters")
            conditions[name] = raw
    return conditions


@dataclass(frozen=True, slots=True)
class Sample:
    """One fresh fan-out: method → engine → outcome (type-checked), and when it was taken."""

    outcomes: Mapping[str, Mapping[str, EngineOutcome]]
    engines: tuple[str, ...]
    taken_at_unix: float
    taken_at: float  # monotonic
    #: Engine → its last fault-tolerance status (absent: never reported); None: this attach
    #: mode cannot know (relay).
    fault_status: Mapping[str, FaultStatus] | None = None
    #: The read methods this sample asked for (a gate's conditions need only theirs).
    asked: frozenset[str] = frozenset()
    #: Engine → seconds without any answer, for the engines the poller reads as hung.
    hung: Mapping[str, float] = field(default_factory=dict)
    #: Engine → its running and waiting requests as vLLM last published them (absent:
    #: unknown); None: this attach mode cannot know.
    requests: Mapping[str, RequestCounts] | None = None


def _health_failure(engine: str, expected: bool, sample: Sample) -> tuple[str | None, bool]:
    """(failure or None, healthy) of one engine for ``healthy=expected``."""
    ft = (sample.fault_status or {}).get(engine)
    healthy = ft is None or not ft.faulty
    if healthy == expected:
        return None, healthy
    why = f" ({ft.fault_info})" if ft is not None and ft.fault_info else ""
    status = ft.status if ft is not None else "healthy"
    return f"{HEALTHY}: fault tolerance reports {status}{why}, expected healthy={expected}", healthy


def _drain_failure(engine: str, expected: bool, sample: Sample) -> tuple[str | None, bool | None]:
    """(failure or None, drained or None when unknown) of one engine for ``drained=expected``:
    drained is ``has_work`` answered false with no published count above zero, by a rank that
    answered ``is_sleeping`` too and is not hung (HTTP mode's ``has_work`` comes from the API
    server's ``/metrics``, which keeps its last values while the engine hangs)."""
    if engine in sample.hung:
        return f"{DRAINED}: unknown, hung", None
    alive = _unanswered(SLEEPING, sample.outcomes.get(SLEEPING.method, {}).get(engine))
    if alive is not None:
        return f"{DRAINED}: unknown, {alive}", None
    o = sample.outcomes.get(HAS_WORK.method, {}).get(engine)
    missing = _unanswered(HAS_WORK, o)
    if missing is not None or o is None:
        return f"{DRAINED}: unknown, {missing or HAS_WORK.key}", None
    counts = (sample.requests or {}).get(engine)
    drained = o.value is False and (counts is None or counts.total == 0)
    if drained == expected:
        return None, drained
    if drained:
        return f"{DRAINED}: no work, expected drained=false", drained
    said = "has work" if o.value else "has_work false but requests published"
    return f"{DRAINED}: {said}{counts_text(counts)}, expected drained=true", drained


def _engine_failures(
    engine: str, conditions: Mapping[str, Any], sample: Sample
) -> tuple[list[str], dict[str, Any]]:
    failures: list[str] = []
    values: dict[str, Any] = {}
    if engine in sample.hung:
        failures.append(f"hung: no answer for {sample.hung[engine]:.0f} s")
    if HEALTHY in conditions:
        failure, values[HEALTHY] = _health_failure(engine, conditions[HEALTHY], sample)
        if failure is not None:
            failures.append(failure)
    if DRAINED in conditions:
        failure, values[DRAINED] = _drain_failure(engine, conditions[DRAINED], sample)
        if failure is not None:
            failures.append(failure)
    wanted: list[Invariant] = [BY_KEY[k] for k in conditions if k not in SPECIAL]
    if SLEEPING not in wanted:
        wanted.insert(0, SLEEPING)  # every engine must answer, conditions or not
    for invariant in wanted:
        o = sample.outcomes.get(invariant.method, {}).get(engine)
        missing = _unanswered(invariant, o)
        if missing is not None or o is None:
            failures.append(missing or invariant.key)
            continue
        values[invariant.key] = o.value
        wanted_value = conditions.get(invariant.key)
        if invariant.key in conditions and invariant.state_of(o.value) != wanted_value:
            failures.append(_mismatch(invariant, o.value, wanted_value))
    return failures, values


def _mismatch(invariant: Invariant, value: Any, expected: Any) -> str:
    """``"paused is True, expected False"``; a checkpoint names its state and error
    (``"checkpoint is 'failed' (CUDA error), expected 'prepared'"``)."""
    if invariant is CHECKPOINT:
        state, error = value
        why = f" ({error})" if error else ""
        return f"{invariant.key} is {state!r}{why}, expected {expected!r}"
    return f"{invariant.key} is {value!r}, expected {expected!r}"


def _unanswered(invariant: Invariant, o: EngineOutcome | None) -> str | None:
    """Why ``invariant`` has no value from one engine (``"paused: unsupported by this
    engine"``, ``"sleeping: timeout"``), or None when it answered."""
    if o is None:
        return f"{invariant.key}: not available in this attach mode"
    if o.outcome is Outcome.OK:
        return None
    why = "unsupported by this engine" if is_unsupported(o) else o.outcome.value
    detail = f" ({o.error})" if o.error and not is_unsupported(o) else ""
    return f"{invariant.key}: {why}{detail}"


def _bare_reads(engine: str, sample: Sample) -> tuple[dict[str, Any], list[str]]:
    """A gate without conditions: every value it read of ``engine`` and why any other is
    missing (``unread``; not failures: only ``sleeping`` must answer). HTTP mode reads a
    plugin-enabled server's engines so."""
    values, unread = {}, []
    for invariant in READS:
        o = sample.outcomes.get(invariant.method, {}).get(engine)
        missing = _unanswered(invariant, o)
        if missing is None and o is not None:
            values[invariant.key] = o.value
        elif invariant is not SLEEPING and invariant.method in sample.asked:
            unread.append(missing or invariant.key)
    return values, unread


def unsupported_conditions(conditions: Mapping[str, Any], sample: Sample) -> list[str]:
    """The conditions that no engine of ``sample`` can answer: every engine lacks the method,
    or the attach mode does not ask it (pure)."""
    if not sample.engines:
        return []
    found = []
    for key in conditions:
        if key == HEALTHY:
            if sample.fault_status is None:
                found.append(key)
            continue
        method = HAS_WORK.method if key == DRAINED else BY_KEY[key].method
        by_engine = sample.outcomes.get(method, {})
        if all(
            (o := by_engine.get(engine)) is None or is_unsupported(o) for engine in sample.engines
        ):
            found.append(key)
    return found


def evaluate(
    conditions: Mapping[str, Any], sample: Sample, now: float
) -> tuple[int, dict[str, Any]]:
    """Pure: (HTTP status, JSON body) of the gate for ``conditions`` over ``sample``."""
    engines = []
    failing = []
    for engine in sample.engines:
        failures, values = _engine_failures(engine, conditions, sample)
        entry = {"engine": engine, "ok": not failures, "values": values, "failures": failures}
        if not conditions:
            entry["values"], entry["unread"] = _bare_reads(engine, sample)
        counts = (sample.requests or {}).get(engine)
        entry["requests"] = None if counts is None else counts.json()
        engines.append(entry)
        if failures:
            failing.append(engine)
    ok = bool(sample.engines) and not failing
    body = {
        "ok": ok,
        "conditions": dict(conditions),
        "engines": engines,
        "failing_engines": failing,
        "checked_at_unix": sample.taken_at_unix,
        "age_s": round(max(0.0, now - sample.taken_at), 3),
    }
    unsupported = unsupported_conditions(conditions, sample)
    if unsupported:
        body["unsupported"] = unsupported
        body["error"] = f"no engine supports {', '.join(unsupported)} (an older vLLM?)"
        return UNSUPPORTED_STATUS, body
    return (200 if ok else 412), body


def needed_methods(conditions: Mapping[str, Any]) -> frozenset[str] | None:
    """The read methods ``conditions`` need (pure): ``is_sleeping`` always (every engine must
    answer), plus each condition's own; None (every method) without conditions."""
    if not conditions:
        return None
    methods = {SLEEPING.method}
    for key in conditions:
        method = SPECIAL[key] if key in SPECIAL else BY_KEY[key].method
        if method is not None:
            methods.add(method)
    return frozenset(methods)


#: How long the next fan-out sleeps at a time while it waits for the rate bound.
RATE_BOUND_STEP_S = 0.05


class Gate:
    """The shared, rate-bounded fresh fan-out behind ``GET /gate``: it asks only what the
    conditions need (``needed_methods``), and starts at most one fan-out per
    ``min_interval_s`` whatever the conditions (the bound is why the gate needs no token)."""

    def __init__(
        self,
        client: FleetClient,
        *,
        timeout_s: float,
        min_interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        reader: FleetRead | None = None,
        hung: Callable[[], Mapping[str, float]] = dict,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._client = client
        #: The poller's read (one memory of unsupported methods), or one of the gate's own.
        self._reader = reader if reader is not None else FleetRead(client)
        #: The engines the poller reads as hung (seconds without an answer), for the reasons.
        self._hung = hung
        self._timeout_s = timeout_s
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._wall = wall_clock
        self._sleep = sleep
        self._last: Sample | None = None
        self._inflight: asyncio.Future[Sample] | None = None
        self._inflight_asks: frozenset[str] = frozenset()
        #: The next fan-out, waiting for the rate bound, and what its callers want.
        self._next: asyncio.Future[Sample] | None = None
        self._next_asks: set[str] = set()
        #: When the last fan-out started (the rate bound counts from there).
        self._last_start = -math.inf
        self.fanouts = 0

    async def sample(self, methods: frozenset[str] | None = None) -> Sample:
        """A sample of ``methods`` (None: every invariant) no older than ``min_interval_s``;
        callers arriving while one that asks at least as much is being taken share it; any
        other caller joins the next fan-out, which starts ``min_interval_s`` after the last
        one started, asking what every caller waiting for it wants."""
        wanted = ALL_METHODS if methods is None else methods | {SLEEPING.method}
        last = self._last
        if (
            last is not None
            and wanted <= last.asked
            and self._clock() - last.taken_at < self._min_interval_s
        ):
            return last
        inflight = self._inflight
        if inflight is None or inflight.done() or not wanted <= self._inflight_asks:
            if self._next is None or self._next.done():
                self._next_asks = set(wanted)
                self._next = asyncio.ensure_future(self._scheduled())
            else:
                self._next_asks |= wanted
            inflight = self._next
        # Shielded: one caller hanging up does not cancel the others' fan-out.
        return await asyncio.shield(inflight)

    async def _scheduled(self) -> Sample:
        """The next fan-out, once the rate bound allows it. One that had to wait asks every
        read method: callers alternating conditions are then all answered from it until it is
        ``min_interval_s`` old, so they cannot buy a fan-out each."""
        # In short steps: an admin action lifts the bound meanwhile (``invalidate``).
        while (wait := self._last_start + self._min_interval_s - self._clock()) > 0:
            await self._sleep(min(wait, RATE_BOUND_STEP_S))
            self._next_asks |= ALL_METHODS
        wanted = frozenset(self._next_asks)
        self._inflight, self._inflight_asks = self._next, wanted
        self._next = None
        return await self._take(wanted)

    async def _take(self, wanted: frozenset[str]) -> Sample:
        self.fanouts += 1
        self._last_start = self._clock()
        reading = await self._reader.read(wanted, self._timeout_s)
        outcomes = {method: {o.engine: o for o in got} for method, got in reading.outcomes.items()}
        # The details as the fan-out left them: HTTP mode refreshes each server's
        # fault-tolerance status with it, and reads the request counts with has_work.
        capable = self._client.capabilities
        after = reading.details.values()
        faults = requests = None
        if capable.fault_status:
            faults = {d.engine: d.fault_status for d in after if d.fault_status is not None}
        if capable.request_counts:
            requests = {d.engine: d.requests for d in after if d.requests is not None}
        sample = Sample(
            outcomes,
            reading.engines,
            self._wall(),
            self._clock(),
            faults,
            wanted,
            dict(self._hung()),
            requests,
        )
        self._last = sample
        return sample

    def invalidate(self) -> None:
        """Forget the shared sample (an admin action just changed the state): the next caller
        gets a fan-out that starts after the change, never one started before it, and at once
        (an action is the admin's, itself guarded and rate-limited: the bound is lifted)."""
        self._last = None
        self._inflight = None
        self._last_start = -math.inf

    async def check(self, conditions: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        if connected_count(self._client) == 0:
            return 503, {
                "ok": False,
                "conditions": dict(conditions),
                "error": "no engine is connected",
                "engines": [],
                "failing_engines": list(self._client.engine_labels),
            }
        return evaluate(conditions, await self.sample(needed_methods(conditions)), self._clock())
