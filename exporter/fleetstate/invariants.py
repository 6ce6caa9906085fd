"""The fleet invariants the exporter checks on every rank, and its activity read, as pure data
and functions.

Each is one read-only utility method with the strict consensus semantics of ``is_sleeping``
(``exporter.fleetstate.aggregate.aggregate_consensus``). An engine whose vLLM lacks the method
answers "no such attribute": that engine is *unsupported* for it, which is neither a failure nor an
unknown value (the aggregate is taken over the engines that support it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.protocol.checkpoint import checkpoint_state_of, is_checkpoint
from exporter.protocol.strings import bound_text

#: What vLLM's dispatch answers for a method the engine does not have (docs/protocol.md C.3),
#: and what the HTTP transport answers for a route the API server does not have.
UNSUPPORTED_MARKERS = (
    "object has no attribute",
    "route not found on this server",
    "unsupported by this engine",  # the gate's wording (a plugin-enabled server in HTTP mode)
    "not published by this server",  # HTTP mode: no request counts in /metrics (has_work)
)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_version(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Invariant:
    """A polled invariant: its utility method, its short key (status, gate) and value type;
    ``state_of`` is what of a value a condition or a read-back compares (the value itself, or
    the state of a ``(state, error)`` pair)."""

    method: str
    key: str
    expected: str
    valid: Callable[[Any], bool]
    state_of: Callable[[Any], Any] = _same


SLEEPING = Invariant("is_sleeping", "sleeping", "a boolean", _is_bool)
PAUSED = Invariant("is_scheduler_paused", "paused", "a boolean", _is_bool)
WEIGHT_VERSION = Invariant("get_weight_version", "weight_version", "a string or null", _is_version)
#: vLLM 0.34's process-checkpoint state per engine: ``(state, error)``
#: (``exporter.protocol.checkpoint``); older engines lack it (unsupported).
CHECKPOINT = Invariant(
    "checkpoint_state",
    "checkpoint",
    "a checkpoint state and its error",
    is_checkpoint,
    checkpoint_state_of,
)
INVARIANTS: tuple[Invariant, ...] = (SLEEPING, PAUSED, WEIGHT_VERSION, CHECKPOINT)
#: Whether the engine should be stepped (vLLM's ``EngineCore.has_work``: requests in its
#: scheduler, a batch queued, a DP wave running). Read every poll like the invariants, but not
#: one: ranks differ in their work by design, so it has no fleet consensus.
HAS_WORK = Invariant("has_work", "has_work", "a boolean", _is_bool)
#: Every per-rank read of a poll: the invariants, then the activity read.
READS: tuple[Invariant, ...] = (*INVARIANTS, HAS_WORK)
#: vLLM 0.34's ``is_inference_ready()``: not sleeping, not paused, no weight update under way.
#: It is a collective RPC to the engine's workers (it waits for a hung worker), so it is asked
#: only on demand, by the gate's ``inference_ready`` condition, never by a poll.
INFERENCE_READY = Invariant("is_inference_ready", "inference_ready", "a boolean", _is_bool)
ON_DEMAND: tuple[Invariant, ...] = (INFERENCE_READY,)
BY_METHOD = {inv.method: inv for inv in (*READS, *ON_DEMAND)}
#: The gate's conditions on one read's value, by key (``has_work`` is the gate's ``drained``).
BY_KEY = {inv.key: inv for inv in (*INVARIANTS, *ON_DEMAND)}


def is_unsupported(outcome: EngineOutcome) -> bool:
    """The engine answered that it has no such method (an older vLLM)."""
    return (
        outcome.outcome is Outcome.FAILED
        and outcome.error is not None
        and any(marker in outcome.error for marker in UNSUPPORTED_MARKERS)
    )


def require_type(invariant: Invariant, outcomes: Iterable[EngineOutcome]) -> list[EngineOutcome]:
    """OK outcomes whose value is not of the invariant's type become FAILED ones."""
    checked = []
    for o in outcomes:
        if o.outcome is Outcome.OK and not invariant.valid(o.value):
            o = EngineOutcome(
                o.engine,
                Outcome.FAILED,
                error=bound_text(f"expected {invariant.expected}, got {o.value!r}"),
                duration_s=o.duration_s,
            )
        checked.append(o)
    return checked
