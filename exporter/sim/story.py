"""The demo's scripted story: a pure function of time, so every metric moves within a minute.

Per period P: the whole fleet pauses its scheduler (0.10-0.20 P), sleeps (0.30-0.65 P) with the
last engine lagging behind by ``lag`` seconds on the way in and out (an inconsistency window),
and the second engine refuses prefix-cache resets during the second half of every period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoryState:
    paused: bool
    sleeping: bool
    refuse_reset: bool


def story_state(offset: int, count: int, t: float, period_s: float) -> StoryState:
    """Desired state of the engine at ``offset`` (0-based within the fleet) at time ``t``."""
    phase = (t % period_s) / period_s
    lag = 0.1 if offset == count - 1 and count > 1 else 0.0
    sleeping = 0.30 + lag <= phase < 0.65 + lag
    paused = 0.10 <= phase < 0.20
    refuse = offset == 1 and phase >= 0.5
    return StoryState(paused=paused, sleeping=sleeping, refuse_reset=refuse)


async def run_story(
    apply: Callable[[StoryState], None], offset: int, count: int, period_s: float
) -> None:
    """Until cancelled, ``apply`` the demo story's state of the engine at ``offset`` (of
    ``count``) a few times a second. Wall-clock time: engines in different processes share the
    story's phase."""
    while True:
        apply(story_state(offset, count, time.time(), period_s))
        await asyncio.sleep(min(0.2, period_s / 50))
