"""Subprocesses of the suite: simulated engines, the command line, the process table.

Every wait is bounded; every process a test starts is stopped (SIGKILL as the last resort).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
WAIT_S = 5.0


def python_cmd(*args: str) -> list[str]:
    """``python -m exporter ARGS``."""
    return [PYTHON, "-m", "exporter", *args]


def clean_env() -> dict[str, str]:
    """The test process's environment without VLLM_DP_EXPORTER_* (no leaks into children)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_EXPORTER_")}


async def run_cli(*args: str, timeout_s: float = 20.0) -> tuple[int, str, str]:
    """Run ``python -m exporter ARGS`` without blocking the event loop (the server lives there)."""
    proc = await asyncio.create_subprocess_exec(
        *python_cmd(*args),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=clean_env(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class SimProcess:
    """``python -m exporter sim-engine`` as a subprocess (killable with SIGKILL)."""

    def __init__(self, handshake_address: str, index: int, *extra: str) -> None:
        self.args = python_cmd(
            "--log-level",
            "warning",
            "sim-engine",
            "--handshake-address",
            handshake_address,
            "--engine-index",
            str(index),
            *extra,
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SimProcess:
        self.proc = subprocess.Popen(
            self.args,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(WAIT_S)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def sim_processes(*procs: SimProcess) -> Iterator[list[SimProcess]]:
    """Start ``procs``; kill whatever still runs on the way out."""
    try:
        yield [p.start() for p in procs]
    finally:
        for p in procs:
            p.kill()


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """Best-effort teardown of a process this test started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout_s)


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc/*/stat (no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (2nd field) may contain spaces; fields resume after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def can_bind(port: int) -> bool:
    """True when a listening TCP socket could take ``port`` now (nobody listens on it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True
