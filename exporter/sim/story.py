"""The demo's scripted story: a pure function of time, so every metric moves within a minute.

Per period P: the whole fleet pauses its scheduler (0.10-0.20 P), sleeps (0.30-0.65 P) with the
last engine lagging behind by ``lag`` seconds on the way in and out (an inconsistency window),
the second engine refuses prefix-cache resets during the second half of every period, and the
first engine's fault-tolerance sentinel reports it unhealthy (0.75-0.85 P) and healthy again.
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


def story_state(offset: int, count: int, t: float, period_s: float) -> StoryState:
    """Desired state of the engine at ``offset`` (0-based within the fleet) at time ``t``."""
    phase = (t % period_s) / period_s
    lag = 0.1 if offset == count - 1 and count > 1 else 0.0
    sleeping = 0.30 + lag <= phase < 0.65 + lag
    paused = 0.10 <= phase < 0.20
    refuse = offset == 1 and phase >= 0.5
    fault = "unhealthy" if offset == 0 and 0.75 <= phase < 0.85 else "healthy"
    return StoryState(paused=paused, sleeping=sleeping, refuse_reset=refuse, fault=fault)


async def run_story(
    apply: Callable[[StoryState], None],
    offset: int,
    count: int,
    period_s: float,
    report_fault: Callable[[str], Awaitable[None]] | None = None,
) -> None:
    """Until cancelled, ``apply`` the demo story's state of the engine at ``offset`` (of
    ``count``) a few times a second, and ``report_fault`` its fault-tolerance status once at
    the start and at every change. Wall-clock time: engines in different processes share the
    story's phase."""
    reported: str | None = None
    while True:
        story = story_state(offset, count, time.time(), period_s)
        apply(story)
        if report_fault is not None and story.fault != reported:
            reported = story.fault
            await report_fault(story.fault)
        await asyncio.sleep(min(0.2, period_s / 50))
