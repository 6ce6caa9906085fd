"""Profiles of the hot paths: pyinstrument (sampling; self and inclusive time per function)
when it is installed, and cProfile (deterministic; calls per operation) always.

``pip install pyinstrument`` into the venv for the sampling part; without it only the cProfile
tables are written.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

IDLE_FUNCTIONS = frozenset({"select", "poll", "epoll.poll", "zmq_poll"})


@dataclass
class Row:
    function: str
    where: str
    value: float  # seconds (self or inclusive) per operation
    share: float  # fraction of the busy (non-idle) sampled time
    calls: float = 0.0  # calls per operation (cProfile only)


@dataclass
class Profile:
    title: str
    operations: int
    wall_per_op: float = 0.0
    sampler: str = ""
    idle_share: float = 0.0
    top_self: list[Row] = field(default_factory=list)
    top_inclusive: list[Row] = field(default_factory=list)
    top_calls: list[Row] = field(default_factory=list)
    calls_per_op: float = 0.0
    categories: dict[str, float] = field(default_factory=dict)  # share of busy sampled time


def category(path: str) -> str:
    """Coarse owner of a source file, for the busy-time breakdown."""
    if "/zmq/_future.py" in path or "/zmq/asyncio" in path:
        return "pyzmq asyncio layer (zmq/_future.py)"
    if "/zmq/" in path:
        return "pyzmq sockets (zmq/sugar)"
    if "/asyncio/" in path or path.endswith("selectors.py"):
        return "asyncio loop, tasks, futures"
    if "/exporter/" in path:
        return "exporter code (incl. msgspec C calls)"
    if "/prometheus_client/" in path:
        return "prometheus_client"
    if "/bench/" in path:
        return "bench harness (incl. floor)"
    return "other (stdlib, enum, dataclasses ...)"


def _short(path: str) -> str:
    for marker in ("site-packages/", "/lib/python3", "/work/main/"):
        if marker in path:
            return path.split(marker, 1)[1].lstrip("/")
    return path.rsplit("/", 2)[-1] if "/" in path else path


def _walk_pyinstrument(profile: Profile, session: Any, top: int) -> None:
    root = session.root_frame()
    if root is None:
        return
    selfs: dict[tuple[str, str], float] = {}
    cats: dict[str, float] = {}
    incl: dict[tuple[str, str], float] = {}

    def visit(frame: Any, active: frozenset[tuple[str, str]]) -> None:
        if frame.is_synthetic:
            return
        key = (frame.function, f"{_short(frame.file_path or '')}:{frame.line_no}")
        selfs[key] = selfs.get(key, 0.0) + frame.total_self_time
        if frame.function not in IDLE_FUNCTIONS:
            cat = category(frame.file_path or "")
            cats[cat] = cats.get(cat, 0.0) + frame.total_self_time
        if key not in active:
            incl[key] = incl.get(key, 0.0) + frame.time
            active = active | {key}
        for child in frame.children:
            visit(child, active)

    visit(root, frozenset())
    total = root.time or 1e-12
    idle = sum(v for (fn, _), v in selfs.items() if fn in IDLE_FUNCTIONS)
    busy = max(total - idle, 1e-12)
    ops = max(profile.operations, 1)
    profile.idle_share = idle / total
    profile.categories = {k: v / busy for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}
    profile.top_self = [
        Row(fn, where, v / ops, v / busy)
        for (fn, where), v in sorted(selfs.items(), key=lambda kv: -kv[1])
        if fn not in IDLE_FUNCTIONS
    ][:top]
    profile.top_inclusive = [
        Row(fn, where, v / ops, v / busy)
        for (fn, where), v in sorted(incl.items(), key=lambda kv: -kv[1])
        if fn not in IDLE_FUNCTIONS and v < total * 0.999
    ][:top]


def _cprofile_rows(profile: Profile, prof: cProfile.Profile, top: int) -> None:
    stats = pstats.Stats(prof)
    ops = max(profile.operations, 1)
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    rows = []
    total_tt = 0.0
    total_calls = 0
    for (path, line, fn), (_cc, nc, tt, _ct, _callers) in raw.items():
        if fn in IDLE_FUNCTIONS or "method 'poll'" in fn or "'select'" in fn:
            continue
        total_tt += tt
        total_calls += nc
        rows.append((fn, f"{_short(path)}:{line}" if line else _short(path), tt, nc))
    rows.sort(key=lambda r: -r[2])
    profile.calls_per_op = total_calls / ops
    profile.top_calls = [
        Row(fn, where, tt / ops, tt / max(total_tt, 1e-12), nc / ops)
        for fn, where, tt, nc in rows[:top]
    ]


def _pyinstrument() -> Any:
    try:
        from pyinstrument import Profiler
    except ImportError:
        return None
    return Profiler(interval=0.0002, async_mode="disabled")


async def profile_async(
    title: str, operations: int, work: Callable[[], Awaitable[None]], top: int = 12
) -> Profile:
    """Run ``work`` under pyinstrument (if installed), then again under cProfile."""
    profile = Profile(title, operations)
    sampler = _pyinstrument()
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.start()
        try:
            await work()
        finally:
            sampler.stop()
        profile.sampler = "pyinstrument"
        _walk_pyinstrument(profile, sampler.last_session, top)
    else:
        await work()
    profile.wall_per_op = (time.perf_counter() - t0) / max(operations, 1)
    prof = cProfile.Profile()
    prof.enable()
    try:
        await work()
    finally:
        prof.disable()
    _cprofile_rows(profile, prof, top)
    return profile


def profile_sync(title: str, operations: int, work: Callable[[], None], top: int = 12) -> Profile:
    profile = Profile(title, operations)
    sampler = _pyinstrument()
    t0 = time.perf_counter()
    if sampler is not None:
        sampler.start()
        try:
            work()
        finally:
            sampler.stop()
        profile.sampler = "pyinstrument"
        _walk_pyinstrument(profile, sampler.last_session, top)
    else:
        work()
    profile.wall_per_op = (time.perf_counter() - t0) / max(operations, 1)
    prof = cProfile.Profile()
    prof.enable()
    try:
        work()
    finally:
        prof.disable()
    _cprofile_rows(profile, prof, top)
    return profile
