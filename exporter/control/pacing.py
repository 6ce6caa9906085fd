"""A paced poll: the engines read a burst at a time, the bursts spread over the poll interval.

Reading every engine at once sends one burst of calls per poll (256 engines and five reads:
1,280 calls, then as many replies drained in one go on vLLM's event loop in-process). A paced
poll splits the engines, in the client's order, into ``ceil(n / engines_per_burst)`` bursts of
nearly equal size; burst ``k`` of ``K`` starts ``k / K`` of the interval after the poll began,
so an engine is read at the same offset every poll while the fleet is unchanged. The snapshot
is built once, from every burst's answers, when the last burst is in: each value in it was
read within the last interval.

Strict consensus needs answers read together: a fleet that changes state while a paced poll
runs (every rank put to sleep) would show its first bursts asleep and its last ones awake. A
disagreement among the bursts is therefore confirmed by one read of that method from every
engine at once before it is published (``confirm``): what is inconsistent then was so at one
moment, as without pacing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from exporter.client.fleet import EngineOutcome
from exporter.control.build import CONSENSUS_METHODS
from exporter.control.fleetread import ALL_METHODS, FleetReading
from exporter.control.sources import ReadingSource
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.fleetstate.invariants import is_unsupported

T = TypeVar("T")


def bursts(engines: Sequence[T], engines_per_burst: int) -> list[tuple[T, ...]]:
    """``engines`` in bursts of at most ``engines_per_burst``, of nearly equal size, in order
    (0: one burst of every engine)."""
    count = len(engines)
    if engines_per_burst <= 0 or count <= engines_per_burst:
        return [tuple(engines)]
    groups = -(-count // engines_per_burst)
    return [tuple(engines[k * count // groups : (k + 1) * count // groups]) for k in range(groups)]


def offsets(groups: int, interval_s: float) -> list[float]:
    """Seconds after a paced poll's start at which each of ``groups`` bursts starts (even)."""
    return [k * interval_s / groups for k in range(groups)]


@dataclasses.dataclass
class PaceCounts:
    """What paced polls did: bursts read, and disagreements confirmed by a read at once."""

    bursts: int = 0
    confirmations: int = 0
    #: Seconds the last paced poll waited between its bursts (not part of its duration).
    last_wait_s: float = 0.0


async def paced_read(
    source: ReadingSource,
    groups: Sequence[tuple[str, ...]],
    interval_s: float,
    timeout_s: float,
    counts: PaceCounts,
    clock: Callable[[], float] = time.monotonic,
    listen: float | None = None,
) -> FleetReading:
    """One poll's reading, a burst of ``groups`` at a time at its offset, then every
    disagreement confirmed (module docstring); ``listen`` as ``FleetRead.read``'s."""
    start = clock()
    counts.last_wait_s = 0.0
    merged: dict[str, list[EngineOutcome]] = {}
    last: FleetReading | None = None
    starts = offsets(len(groups), interval_s)
    for position, (group, offset) in enumerate(zip(groups, starts, strict=True)):
        wait = start + offset - clock()
        if wait > 0:
            await asyncio.sleep(wait)
            counts.last_wait_s += wait
        final = position == len(groups) - 1
        last = await source.read(
            ALL_METHODS, timeout_s, progress=final, engines=group, listen=listen
        )
        counts.bursts += 1
        for method, outcomes in last.outcomes.items():
            merged.setdefault(method, []).extend(outcomes)
    assert last is not None, "a paced poll has at least one burst"
    # The merge below reads every engine's outcomes: in turns of their own (in-process mode
    # shares vLLM's loop), not in the last burst's.
    await asyncio.sleep(0)
    for method in sorted(CONSENSUS_METHODS & merged.keys()):
        answered = [o for o in merged[method] if not is_unsupported(o)]
        if aggregate_consensus(method, answered).state is FleetState.INCONSISTENT:
            again = await source.read((method,), timeout_s)
            counts.confirmations += 1
            merged[method] = list(again.outcomes.get(method, merged[method]))
    await asyncio.sleep(0)
    order = {engine: i for i, engine in enumerate(last.details)}
    for outcomes in merged.values():
        outcomes.sort(key=lambda o: order.get(o.engine, len(order)))
    return dataclasses.replace(last, outcomes=merged)
