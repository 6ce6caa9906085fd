"""The demo's scripted story: a pure function of time, so every metric moves within a minute.

Per period P: the whole fleet pauses its scheduler (0.10-0.20 P), sleeps (0.30-0.65 P) with the
last engine lagging behind by ``lag`` seconds on the way in and out (an inconsistency window),
the second engine refuses prefix-cache resets during the second half of every period, and the
first engine's fault-tolerance sentinel reports it unhealthy (0.75-0.85 P) and healthy again.

Requests arrive at every engine while it is awake and traffic flows (0.00-0.04, 0.22-0.28 and
0.68-1.00 P): traffic stops before the pause so the fleet drains (has_work goes false), and
while paused the last engine gets one request that waits behind the pause (a rank holding work
while unroutable). The second engine (the only one of a fleet of one) stops answering from
0.86 P to the end of the period (hung, then it recovers by itself).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoryState:
    paused: bool
    sleeping: bool
    refuse_reset: bool
    #: The fault-tolerance status the engine pushes (vLLM's sentinel: ``healthy``,
    #: ``unhealthy``).
    fault: str = "healthy"
    #: Requests arrive (``exporter.sim.work.DEMO_ARRIVAL_S``, ``DEMO_REQUEST_S``).
    traffic: bool = False
    #: One request arrives while paused and waits behind the pause.
    queue_behind_pause: bool = False
    #: The engine answers nothing (a wedged collective), and recovers by itself.
    hung: bool = False


def story_state(offset: int, count: int, t: float, period_s: float) -> StoryState:
    """Desired state of the engine at ``offset`` (0-based within the fleet) at time ``t``."""
    phase = (t % period_s) / period_s
    lag = 0.1 if offset == count - 1 and count > 1 else 0.0
    sleeping = 0.30 + lag <= phase < 0.65 + lag
    paused = 0.10 <= phase < 0.20
    refuse = offset == 1 and phase >= 0.5
    fault = "unhealthy" if offset == 0 and 0.75 <= phase < 0.85 else "healthy"
    traffic = phase < 0.04 or 0.22 <= phase < 0.28 or phase >= 0.68
    queued = offset == count - 1 and 0.14 <= phase < 0.20
    hung = offset == min(1, count - 1) and phase >= 0.86
    return StoryState(
        paused=paused,
        sleeping=sleeping,
        refuse_reset=refuse,
        fault=fault,
        traffic=traffic and not (paused or sleeping),
        queue_behind_pause=queued,
        hung=hung,
    )


async def run_story(
    apply: Callable[[StoryState, float], None],
    offset: int,
    count: int,
    period_s: float,
    report_fault: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """Until cancelled, ``apply`` the demo story's state of the engine at ``offset`` (of
    ``count``) a few times a second (with ``time.monotonic()``, the engine's clock), and
    ``report_fault`` its fault-tolerance status once at the start and at every change. The
    phase comes from wall-clock time: engines in different processes share it."""
    reported: str | None = None
    while True:
        story = story_state(offset, count, time.time(), period_s)
        apply(story, time.monotonic())
        if report_fault is not None and story.fault != reported:
            reported = story.fault
            await report_fault(story.fault)
        await asyncio.sleep(min(0.2, period_s / 50))
