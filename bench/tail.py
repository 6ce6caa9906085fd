"""Where the p99 of an aggregated call goes: per-call wall time, process CPU and GC pause.

A slow call (at or above the p99 wall time) that used no more CPU than a median call was
*waiting*: for the engines (one simulated-engine process answers its engines one after the
other) or for the scheduler on a shared 2-core machine, not for exporter work. Extra CPU in the
slow calls is exporter work (per-reply processing, a loop turn that batched more), and the GC
column tells how much of that was garbage collection. The floor gets the same columns, so
waiting common to both sides shows up on both.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any


class GcClock:
    """Total time spent in garbage collection while installed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self.collections = 0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started
            self.collections += 1

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@dataclass(frozen=True)
class CallSample:
    wall_s: float
    cpu_s: float
    gc_s: float


@dataclass(frozen=True)
class Tail:
    """The calls at or above the p99 wall time, against the median call."""

    calls: int
    tail_calls: int
    p50_wall_s: float
    p99_wall_s: float
    median_cpu_s: float
    tail_cpu_s: float  # mean over the tail calls
    tail_gc_s: float  # mean over the tail calls
    all_gc_s: float  # mean over every call
    tail_with_gc: float  # fraction of tail calls during which a collection ran

    @property
    def wall_excess_s(self) -> float:
        return self.p99_wall_s - self.p50_wall_s

    @property
    def cpu_excess_s(self) -> float:
        return max(0.0, self.tail_cpu_s - self.median_cpu_s)


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def tail_of(samples: list[CallSample]) -> Tail:
    """Split ``samples`` at the p99 wall time (nearest rank)."""
    if not samples:
        raise ValueError("no calls")
    walls = [s.wall_s for s in samples]
    p99 = percentile(walls, 99)
    tail = [s for s in samples if s.wall_s >= p99]
    return Tail(
        calls=len(samples),
        tail_calls=len(tail),
        p50_wall_s=percentile(walls, 50),
        p99_wall_s=p99,
        median_cpu_s=statistics.median(s.cpu_s for s in samples),
        tail_cpu_s=statistics.fmean(s.cpu_s for s in tail),
        tail_gc_s=statistics.fmean(s.gc_s for s in tail),
        all_gc_s=statistics.fmean(s.gc_s for s in samples),
        tail_with_gc=sum(1 for s in tail if s.gc_s > 0) / len(tail),
    )
