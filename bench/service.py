"""Measurements of ``python -m exporter serve`` as a subprocess: CPU share at a 1 s poll
interval, RSS, admin reset latency over real HTTP, and RSS under a flapping engine.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from bench.procs import (
    EngineFleet,
    engine_fleet,
    free_address,
    http_get,
    metric_value,
    proc_cpu_seconds,
    proc_rss_kib,
    serve_process,
    spawn,
    stop_process,
    wait_ready,
)
from bench.tail import percentile


@dataclass
class ServeCpuResult:
    n: int
    poll_interval: float
    window_s: float
    cpu_s: float
    polls: int
    rss_kib: int

    @property
    def share(self) -> float:
        return self.cpu_s / self.window_s

    @property
    def cpu_per_poll(self) -> float:
        return self.cpu_s / max(self.polls, 1)


@dataclass
class AdminResult:
    n: int
    calls: int
    p50: float
    p99: float
    statuses: dict[int, int]


@dataclass
class RssResult:
    n: int
    rss_kib: int
    polls: int


@dataclass
class FlapResult:
    n: int
    poll_interval: float
    points: list[tuple[int, int]] = field(default_factory=list)  # (polls, RSS KiB)
    flaps: int = 0
    handshakes: int = 0
    elapsed_s: float = 0.0
    disconnected_calls: float = 0.0
    timeout_calls: float = 0.0


def _polls(url: str) -> int:
    _, body = http_get(url + "/metrics", 5.0)
    value = metric_value(body.decode(), "vllm_dp_polls_total")
    return int(value or 0)


def _wait_polls(url: str, at_least: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        polls = _polls(url)
        if polls >= at_least or time.monotonic() > deadline:
            return polls
        time.sleep(0.05)


def serve_cpu_and_admin(
    n: int, window_s: float, admin_calls: int, log_dir: Path, poll_interval: float = 1.0
) -> tuple[ServeCpuResult, AdminResult]:
    """N engines, serve polling every ``poll_interval``: CPU share over ``window_s``, then
    admin resets."""
    address = free_address()
    with (
        engine_fleet(address, n, log_dir),
        serve_process(address, n, log_dir, poll_interval=poll_interval, admin=True) as serve,
    ):
        wait_ready(serve, 120.0)
        start_polls = _wait_polls(serve.url, 3, 30.0)
        cpu0, t0 = proc_cpu_seconds(serve.pid), time.monotonic()
        time.sleep(window_s)
        cpu1, t1 = proc_cpu_seconds(serve.pid), time.monotonic()
        polls = _polls(serve.url) - start_polls  # scraped after the window
        cpu = ServeCpuResult(n, poll_interval, t1 - t0, cpu1 - cpu0, polls, proc_rss_kib(serve.pid))
        assert serve.admin_url is not None
        admin = _admin_resets(serve.admin_url, n, admin_calls)
    return cpu, admin


def _admin_resets(admin_url: str, n: int, calls: int) -> AdminResult:
    parts = urlsplit(admin_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10.0)
    samples: list[float] = []
    statuses: dict[int, int] = {}
    try:
        for i in range(calls + 5):
            t0 = time.perf_counter()
            conn.request("POST", "/admin/reset_prefix_cache", body=b"")
            resp = conn.getresponse()
            body = resp.read()
            elapsed = time.perf_counter() - t0
            if i < 5:
                continue  # warm-up
            statuses[resp.status] = statuses.get(resp.status, 0) + 1
            if resp.status == 200 and json.loads(body).get("success"):
                samples.append(elapsed)
    finally:
        conn.close()
    if not samples:
        raise RuntimeError(f"no successful admin reset: {statuses}")
    return AdminResult(n, len(samples), percentile(samples, 50), percentile(samples, 99), statuses)


def serve_rss(n: int, log_dir: Path, polls: int = 5, poll_interval: float = 1.0) -> RssResult:
    """RSS of a serve process attached to N engines after a few polls."""
    address = free_address()
    with (
        engine_fleet(address, n, log_dir),
        serve_process(address, n, log_dir, poll_interval=poll_interval) as serve,
    ):
        wait_ready(serve, 180.0)
        done = _wait_polls(serve.url, polls, 60.0)
        return RssResult(n, proc_rss_kib(serve.pid), done)


class _Flapper(threading.Thread):
    """Keeps one engine process flapping: ENGINE_CORE_DEAD after some calls, or SIGKILL."""

    def __init__(self, address: str, index: int, log_dir: Path, dead_after_calls: int) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.index = index
        self.log_dir = log_dir
        self.dead_after_calls = dead_after_calls
        self.stop_event = threading.Event()
        self.flaps = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            cycle = 0
            while not self.stop_event.is_set():
                cycle += 1
                killed = cycle % 2 == 0
                args = [
                    "sim-engine",
                    "--handshake-address",
                    self.address,
                    "--engine-index",
                    str(self.index),
                    "--handshake-timeout",
                    "60",
                ]
                if not killed:
                    args += ["--dead-after-calls", str(self.dead_after_calls)]
                proc = spawn(args, self.log_dir / "flapper.log")
                try:
                    if killed:
                        # up for a while, then gone without ENGINE_CORE_DEAD
                        self.stop_event.wait(1.5)
                        proc.kill()
                        proc.wait(timeout=10.0)
                    else:
                        deadline = time.monotonic() + 60.0
                        while proc.poll() is None and time.monotonic() < deadline:
                            if self.stop_event.wait(0.05):
                                break
                finally:
                    stop_process(proc)
                self.flaps += 1
        except BaseException as exc:  # reported by the caller
            self.error = exc


def flapping_memory(
    n: int, checkpoints: list[int], log_dir: Path, *, poll_interval: float, timeout_s: float
) -> FlapResult:
    """RSS of serve at poll-count checkpoints while engine ``n-1`` keeps dying and restarting."""
    address = free_address()
    result = FlapResult(n, poll_interval)
    fleet = EngineFleet(address, n - 1, 1, log_dir)
    flapper = _Flapper(address, n - 1, log_dir, dead_after_calls=200)
    with serve_process(address, n, log_dir, poll_interval=poll_interval, call_timeout=0.5) as serve:
        try:
            fleet.launch()
            flapper.start()
            wait_ready(serve, 60.0)
            started = time.monotonic()
            deadline = started + timeout_s
            pending = sorted(checkpoints)
            while pending and time.monotonic() < deadline:
                if serve.proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {serve.proc.returncode}")
                polls = _polls(serve.url)
                while pending and polls >= pending[0]:
                    result.points.append((pending.pop(0), proc_rss_kib(serve.pid)))
                time.sleep(0.02 if pending and pending[0] - polls < 50 else 0.25)
            result.elapsed_s = time.monotonic() - started
            _, status = http_get(serve.url + "/status", 5.0)
            engines = json.loads(status)["engines"]
            result.handshakes = int(engines[-1]["handshakes"])
            _, body = http_get(serve.url + "/metrics", 5.0)
            text = body.decode()
            result.disconnected_calls = _sum_samples(
                text, "vllm_dp_utility_calls_total", "disconnected"
            )
            result.timeout_calls = _sum_samples(text, "vllm_dp_utility_calls_total", "timeout")
        finally:
            flapper.stop_event.set()
            flapper.join(timeout=30.0)
            fleet.stop()
    result.flaps = flapper.flaps
    if flapper.error is not None:
        raise RuntimeError(f"flapper failed: {flapper.error!r}")
    return result


def _sum_samples(text: str, name: str, label_value: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'"{label_value}"' in line:
            with contextlib.suppress(ValueError):
                total += float(line.rsplit(" ", 1)[1])
    return total
