"""``CountedFleet``: the one place every utility call is counted, whichever path sends it.

The poller, the gate and the admin actions (with their read-backs) all call engines through
this wrapper of the attach mode's ``FleetClient``, so ``vllm_dp_utility_calls_total`` and the
call-duration histogram see every fan-out's outcomes as they come back, and a new caller cannot
forget to count. Labels stay bounded: the method is on the client's allow-list, the engine is
one of the configured ones, the outcome one of ``Outcome``.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from exporter.client.fleet import (
    Capabilities,
    EngineDetail,
    EngineOutcome,
    FleetClient,
    Outcome,
)
from exporter.client.observe import Observations
from exporter.fleetstate.invariants import BY_METHOD, is_unsupported, require_type
from exporter.metrics.stats import Stats


def countable(method: str, outcomes: list[EngineOutcome]) -> list[EngineOutcome]:
    """The outcomes as counted: an answer "no such method" is not a call outcome (the engine
    is *unsupported* for it, docs/rl.md), and a polled invariant's answer of the wrong type is
    a failed call, as the poller and the gate read it."""
    invariant = BY_METHOD.get(method)
    if all(o.outcome is Outcome.OK for o in outcomes):  # the common case: one pass, no copy
        return outcomes if invariant is None else require_type(invariant, outcomes)
    kept = [o for o in outcomes if not is_unsupported(o)]
    return require_type(invariant, kept) if invariant is not None else kept


class CountedFleet:
    """A ``FleetClient`` that records every outcome of ``inner``'s calls in ``stats``."""

    def __init__(self, inner: FleetClient, stats: Stats) -> None:
        self.inner = inner
        self._stats = stats

    @property
    def capabilities(self) -> Capabilities:
        return self.inner.capabilities

    @property
    def engine_labels(self) -> list[str]:
        return self.inner.engine_labels

    def engine_details(self) -> list[EngineDetail]:
        return self.inner.engine_details()

    @property
    def observations(self) -> Observations:
        return self.inner.observations

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        outcomes = await self.inner.call_utility(method, args, timeout_s=timeout_s, engines=engines)
        counted = countable(method, outcomes)
        if counted:
            self._stats.record_calls(method, counted)
        return outcomes
