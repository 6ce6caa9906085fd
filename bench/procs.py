"""Subprocess helpers: free ports, simulated engine processes, the ``serve`` subprocess.

Every address is 127.0.0.1, every wait is bounded, and every process started here is stopped by
``stop_process`` (SIGTERM, then SIGKILL after a bounded wait).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from exporter.base.ports import free_listen_port

HOST = "127.0.0.1"


def free_address() -> str:
    return f"tcp://{HOST}:{free_listen_port()}"


def split_counts(total: int, processes: int) -> list[int]:
    """``total`` engines over ``processes`` processes, as evenly as possible."""
    processes = max(1, min(processes, total))
    base, extra = divmod(total, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def engine_processes_for(n: int) -> int:
    """How many sim-engine processes host ``n`` engines on a small machine."""
    if n <= 8:
        return 1
    if n <= 64:
        return 2
    return 4


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL and wait again (bounded)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)


def spawn(args: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``python -m exporter ARGS`` with its output in ``log_path``."""
    log = open(log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "exporter", "--log-level", "warning", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    finally:
        log.close()


@dataclass
class EngineFleet:
    """``count`` simulated engines (ranks ``start..start+count-1``) in ``processes`` processes."""

    handshake_address: str
    count: int
    processes: int
    log_dir: Path
    start: int = 0
    extra_args: tuple[str, ...] = ()
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def launch(self) -> None:
        first = self.start
        for i, k in enumerate(split_counts(self.count, self.processes)):
            args = [
                "sim-engine",
                "--handshake-address",
                self.handshake_address,
                "--engine-index",
                str(first),
                "--engine-count",
                str(k),
                "--handshake-timeout",
                "120",
                *self.extra_args,
            ]
            self.procs.append(spawn(args, self.log_dir / f"engines-{first}-{i}.log"))
            first += k

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            stop_process(proc)
        self.procs.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


@contextlib.contextmanager
def engine_fleet(
    handshake_address: str,
    count: int,
    log_dir: Path,
    *,
    processes: int | None = None,
    start: int = 0,
    extra_args: Sequence[str] = (),
) -> Iterator[EngineFleet]:
    fleet = EngineFleet(
        handshake_address,
        count,
        processes if processes is not None else engine_processes_for(count),
        log_dir,
        start,
        tuple(extra_args),
    )
    try:
        fleet.launch()
        yield fleet
    finally:
        fleet.stop()


# -- the serve subprocess ----------------------------------------------------------------------


@dataclass
class ServeProcess:
    proc: subprocess.Popen[bytes]
    url: str
    admin_url: str | None

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def serve_process(
    handshake_address: str,
    engine_count: int,
    log_dir: Path,
    *,
    poll_interval: float,
    call_timeout: float = 5.0,
    admin: bool = False,
    extra_args: Sequence[str] = (),
) -> Iterator[ServeProcess]:
    port = free_listen_port()
    admin_port = free_listen_port() if admin else None
    args = [
        "serve",
        "--attach",
        "owner",
        "--engine-count",
        str(engine_count),
        "--handshake-address",
        handshake_address,
        "--listen",
        f"{HOST}:{port}",
        "--admin-listen",
        f"{HOST}:{admin_port}" if admin_port else "off",
        "--poll-interval",
        str(poll_interval),
        "--call-timeout",
        str(call_timeout),
        "--reset-min-interval",
        "0",
        *extra_args,
    ]
    env_clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_EXPORTER_")}
    log = open(log_dir / f"serve-{port}.log", "ab")  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "--log-level", "warning", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env_clean,
        )
    finally:
        log.close()
    try:
        yield ServeProcess(
            proc, f"http://{HOST}:{port}", f"http://{HOST}:{admin_port}" if admin_port else None
        )
    finally:
        stop_process(proc)


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def wait_ready(serve: ServeProcess, timeout_s: float) -> None:
    """Poll /readyz until 200; raise on timeout or if the process died."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            raise RuntimeError(f"serve exited with {serve.proc.returncode}")
        try:
            status, body = http_get(serve.url + "/readyz", 2.0)
            if status == 200:
                return
            last = body.decode(errors="replace")
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise TimeoutError(f"exporter not ready within {timeout_s:g}s: {last}")


def metric_value(text: str, name: str) -> float | None:
    """The value of an unlabelled sample ``name`` in a Prometheus text body."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{}"):
            return float(line.rsplit(" ", 1)[1])
    return None


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat.rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def proc_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")
