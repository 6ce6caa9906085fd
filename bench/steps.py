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


#: The probe's coroutine (``bench.plugin_loop.probe``): a trivial step, the machine's floor.
PROBE = "other:probe"


@dataclass
class Window:
    """The longest steps of one poll: the exporter's and the probe's, by this thread's CPU
    time and by the wall clock (the wall also counts the time the thread was not running)."""

    exporter_cpu: float = 0.0
    exporter_wall: float = 0.0
    probe_cpu: float = 0.0
    probe_wall: float = 0.0


@dataclass
class StepLog:
    """The longest step per coroutine name, the exporter's longest overall, and the longest
    steps of each poll (``cut`` ends a poll's window)."""

    longest: dict[str, float] = field(default_factory=dict)
    recording: bool = False
    windows: list[Window] = field(default_factory=list)
    current: Window = field(default_factory=Window)

    def record(self, name: str, seconds: float, wall: float = 0.0) -> None:
        if not self.recording:
            return
        if seconds > self.longest.get(name, 0.0):
            self.longest[name] = seconds
        now = self.current
        if name.startswith("exporter"):
            now.exporter_cpu = max(now.exporter_cpu, seconds)
            now.exporter_wall = max(now.exporter_wall, wall)
        elif name == PROBE:
            now.probe_cpu = max(now.probe_cpu, seconds)
            now.probe_wall = max(now.probe_wall, wall)

    def cut(self) -> None:
        """A poll was published: its window ends (while recording)."""
        if self.recording:
            self.windows.append(self.current)
        self.current = Window()

    def clear(self) -> None:
        self.longest.clear()
        self.current = Window()

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
        started, wall = time.thread_time(), time.perf_counter()
        try:
            return self._inner.send(value)
        finally:
            self._log.record(self._name, time.thread_time() - started, time.perf_counter() - wall)

    def throw(self, *exc: Any) -> Any:
        started, wall = time.thread_time(), time.perf_counter()
        try:
            return self._inner.throw(*exc)
        finally:
            self._log.record(self._name, time.thread_time() - started, time.perf_counter() - wall)

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
