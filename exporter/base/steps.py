"""Work written once as a generator of steps, run either at once or a step per loop turn.

A generator that ``yield``s between bounded pieces of work and ``return``s its result is run
to completion by ``run_steps`` (a plain call: the service's render, tests) or by
``run_steps_async``, which gives the event loop one turn after each piece. In-process mode
shares vLLM's event loop, which streams every token: a render of 256 engines' series must not
hold it for tens of milliseconds (docs/benchmarks/plugin-loop.md). Both run the same code, so
the result cannot differ.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")

#: A generator of steps: yields None between pieces of work, returns its result.
Steps = Generator[None, None, T]

#: The two sizes of a step, for every builder and fan-out that shares an event loop: engines
#: (a table's rows, a fan-out's calls or outcomes) and exposition samples (lines of text).
#: Read when used, so a test can change them here.
ENGINES_PER_STEP = 32
SAMPLES_PER_STEP = 500


def every(position: int, per_step: int = 0) -> bool:
    """Whether a step ends after item ``position`` (1-based): every ``per_step`` items, by
    default ``ENGINES_PER_STEP``. The one way builders decide where to yield."""
    return position % (per_step or ENGINES_PER_STEP) == 0


def run_steps(steps: Steps[T]) -> T:
    """Every step at once."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        result: T = done.value
        return result


async def run_steps_async(steps: Steps[T]) -> T:
    """One step per turn of the running event loop."""
    try:
        while True:
            next(steps)
            await asyncio.sleep(0)
    except StopIteration as done:
        result: T = done.value
        return result
