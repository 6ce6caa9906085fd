"""Which asyncio event loop runs the exporter: uvloop when it is installed, else the stdlib's.

uvloop (libuv, the loop vLLM's API server runs on) does the loop's own work per ready
descriptor, handle and timer in C, which lowers the exporter's CPU per aggregated call (by how
much, on which fleet: ``python -m bench.loops`` and docs/scale.md). ``--event-loop asyncio``
keeps the stdlib loop (a platform without uvloop wheels, or to rule the loop out while
debugging).
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, TypeVar

from exporter.error import ConfigError

T = TypeVar("T")

#: ``auto``: uvloop when importable, else asyncio.
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_value(text: str) -> str:
    """The ``--event-loop`` converter (any case): one of ``EVENT_LOOPS``; ValueError else."""
    value = text.strip().lower()
    if value not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {text!r}")
    return value


event_loop_value.__name__ = "event_loop"


def uvloop_available() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def resolve_event_loop(kind: str) -> str:
    """``uvloop`` or ``asyncio``; ConfigError when uvloop is asked for but not installed."""
    if kind == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    if kind == "uvloop" and not uvloop_available():
        raise ConfigError("--event-loop uvloop: uvloop is not installed (pip install uvloop)")
    return kind


def running_loop_name() -> str:
    """``uvloop`` or ``asyncio``: the loop this coroutine runs on (for the start-up log)."""
    module = type(asyncio.get_running_loop()).__module__
    return "uvloop" if module.startswith("uvloop") else "asyncio"


def run(main: Coroutine[Any, Any, T], kind: str = "auto") -> T:
    """``asyncio.run(main)`` on the resolved loop (a fresh loop, closed afterwards)."""
    try:
        resolved = resolve_event_loop(kind)
    except ConfigError:
        main.close()  # never awaited: no "coroutine was never awaited" warning
        raise
    if resolved == "uvloop":
        import uvloop

        result: T = uvloop.run(main)
        return result
    return asyncio.run(main)
