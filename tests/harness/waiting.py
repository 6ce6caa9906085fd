"""Bounded waiting: the one way the suite waits for a condition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAIT_S = 10.0


async def eventually(
    predicate: Callable[[], bool],
    timeout_s: float = WAIT_S,
    what: str = "condition",
    step_s: float = 0.01,
) -> None:
    """Wait (bounded) until ``predicate()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(step_s)
