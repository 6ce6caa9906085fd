"""Child processes the suite starts: own process group, log file, bounded stop by PID.

vLLM forks engine processes (and those fork compile workers), so a process is always started
in a new session and stopped by signalling its whole process group: nothing is left behind
when a test fails half-way, and nothing outside the suite is ever signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TAIL_LINES = 60


@dataclass
class Managed:
    """One started command: its name (for reports), process and log file."""

    name: str
    argv: Sequence[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    started_at: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last ``lines`` lines of the log (empty when there is none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the process group we created (its id is the leader's PID)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, sig)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the group, wait up to ``grace_s``, then SIGKILL it; returns the exit code.

        The group is killed even when the leader already exited: a dead headless launcher can
        leave engine processes behind in its group.
        """
        if self.alive():
            self.signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=grace_s)
        self.signal_group(signal.SIGKILL)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None


class ProcessGroup:
    """Every process one fixture started; ``stop_all`` stops them in reverse start order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.started: list[Managed] = []

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], cwd: Path | None = None
    ) -> Managed:
        """Start ``argv`` in its own session, stdout and stderr into ``<log_dir>/<name>.log``.

        A name used twice (a restart) gets a numbered log, so the first run's log is kept.
        """
        log_path = self.log_dir / f"{name}.log"
        n = 1
        while log_path.exists():
            n += 1
            log_path = self.log_dir / f"{name}.{n}.log"
        with log_path.open("wb") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        managed = Managed(
            name=f"{name}#{n}" if n > 1 else name, argv=argv, log_path=log_path, popen=popen
        )
        self.started.append(managed)
        return managed

    def stop_all(self) -> None:
        for managed in reversed(self.started):
            managed.stop()

    def tails(self, lines: int = TAIL_LINES) -> str:
        """The log tail of every process this group started, for a failure report."""
        parts = []
        for m in self.started:
            state = "running" if m.alive() else f"exited {m.popen.returncode}"
            parts.append(
                f"----- {m.name} (pid {m.pid}, {state}) {m.log_path} -----\n{m.tail(lines)}"
            )
        return "\n".join(parts)


def descendants(pid: int) -> list[int]:
    """PIDs of every descendant of ``pid`` (from /proc; Linux only), depth first."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found.append(child)
                stack.append(child)
    return found


def process_title(pid: int) -> str:
    """The process's command line as it shows in ps (vLLM sets titles such as
    ``VLLM::EngineCore_DP0``); empty when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def first_exited(*procs: Managed) -> str | None:
    """Names the first of ``procs`` that is no longer running, with its log's tail (for
    ``web.wait_for(abort=...)``: waiting on a dead process would only hide the cause)."""
    for p in procs:
        if not p.alive():
            return f"{p.name} exited with {p.popen.returncode}:\n{p.tail(20)}"
    return None


def cli_flags(**options: object) -> list[str]:
    """``cli_flags(data_parallel_size=2)`` → ``["--data-parallel-size", "2"]``."""
    argv: list[str] = []
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
