"""The benchmark report's data (``Report``), the machine description and number formats."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench.flood import FloodResult
from bench.inprocess import SizeResult
from bench.service import AdminResult, FlapResult, RssResult, ServeCpuResult


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "exporter"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return rev + (" (exporter/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def publish(text: str, out: str) -> None:
    """Print a benchmark's report and write it to ``out`` (``-``: print only)."""
    print(text)
    if out != "-":
        Path(out).write_text(text)


def machine_lines(event_loop: str = "auto") -> list[str]:
    import zmq

    from exporter.base.eventloop import resolve_event_loop

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- Kernel: {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()} ({sys.implementation.name})",
        f"- pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), msgspec {_version('msgspec')}, "
        f"prometheus-client {_version('prometheus-client')}, aiohttp {_version('aiohttp')}, "
        f"pyinstrument {_version('pyinstrument')}, uvloop {_version('uvloop')}",
        f"- event loop of the in-process tables (`--event-loop {event_loop}`): "
        f"{resolve_event_loop(event_loop)}; `serve` subprocesses: "
        f"{resolve_event_loop('auto')} (their default)",
        f"- git revision: {_git_revision()}",
        f"- load average at start (1/5/15 min): {load}",
    ]


@dataclass
class Report:
    command: str
    quick: bool
    machine: list[str]
    sizes: list[SizeResult] = field(default_factory=list)
    serve_cpu: ServeCpuResult | None = None
    admin: AdminResult | None = None
    rss: list[RssResult] = field(default_factory=list)
    flap: FlapResult | None = None
    flood: FloodResult | None = None
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    load_end: str = ""
    baseline: dict[str, float] | None = None
    baseline_source: str = ""


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def verdict(ok: bool) -> str:
    return "met" if ok else "**not met**"
