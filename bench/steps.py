"""How long each task step holds the event loop, by coroutine (``bench.plugin_loop``).

A task factory wraps every coroutine a task runs (on asyncio's loop and uvloop alike): each
``send``/``throw`` is one step of the task, one synchronous stretch on the loop, timed with
this thread's CPU clock (``time.thread_time``), so the simulated engines that share this small
machine's cores do not inflate it. A step is the exporter's when its coroutine's code is in
``exporter/``; steps of the simulated vLLM (its client's sends and output reader) are vLLM's
own work in the real process.
"""

from __future__ import annotations

import asyncio
import collections.abc
import time
from collections.abc import Coroutine, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

EXPORTER_CODE = "/exporter/"


@dataclass
class StepLog:
    """The longest step per coroutine name, and the exporter's longest overall."""

    longest: dict[str, float] = field(default_factory=dict)
    recording: bool = False

    def record(self, name: str, seconds: float) -> None:
        if self.recording and seconds > self.longest.get(name, 0.0):
            self.longest[name] = seconds

    def clear(self) -> None:
        self.longest.clear()

    def exporter_longest(self) -> tuple[float, str]:
        """(seconds, coroutine) of the exporter's longest step; (0, "") when none ran."""
        mine = [(s, n) for n, s in self.longest.items() if n.startswith("exporter")]
        return max(mine, default=(0.0, ""))


class _Timed(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine whose every step is timed into ``log``."""

    def __init__(self, inner: Coroutine[Any, Any, Any], log: StepLog) -> None:
        self._inner = inner
        self._log = log
        code = getattr(inner, "cr_code", None)
        where = "exporter" if code and EXPORTER_CODE in code.co_filename else "other"
        self._name = f"{where}:{getattr(inner, '__qualname__', type(inner).__name__)}"

    def send(self, value: Any) -> Any:
        started = time.thread_time()
        try:
            return self._inner.send(value)
        finally:
            self._log.record(self._name, time.thread_time() - started)

    def throw(self, *exc: Any) -> Any:
        started = time.thread_time()
        try:
            return self._inner.throw(*exc)
        finally:
            self._log.record(self._name, time.thread_time() - started)

    def close(self) -> None:
        self._inner.close()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._inner.__await__()


@contextmanager
def timed_steps(log: StepLog) -> Iterator[StepLog]:
    """Every task created on the running loop inside the block has its steps timed."""
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        return asyncio.Task(_Timed(coro, log), loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        yield log
    finally:
        loop.set_task_factory(previous)
