"""``vllm-dp-exporter demo`` as a real process tree: it serves, its metrics move, and
SIGTERM stops it cleanly (exit 0, no orphaned engine processes)."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.base.ports import free_listen_port
from tests.harness.processes import (
    ROOT,
    children_of,
    clean_env,
    process_alive,
    python_cmd,
    terminate,
)

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError):
        return None
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _wait_or_dump(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> int:
    """``proc``'s exit code; if it has not exited within ``timeout_s``, fail with every
    thread's stack (``kill -USR1``, the CLI's faulthandler) and its log."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1)
        raise AssertionError(
            f"no exit within {timeout_s:g} s of SIGTERM; its stacks and log:\n"
            + log_path.read_text()[-20000:]
        ) from None


def _run_demo_until(
    tmp_path: Path, attach: str, check: object, children: int | None = None, timeout_s: float = 25
) -> None:
    """Start ``demo --attach ATTACH``, wait until ``check(metrics)`` holds, SIGTERM: exit 0
    within a few seconds and no orphaned child processes."""
    port, admin_port = free_listen_port(), free_listen_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / f"demo-{attach}.log"
    log = log_path.open("w+b")
    proc = subprocess.Popen(
        python_cmd(
            "--log-level",
            "warning",
            "demo",
            "--attach",
            attach,
            "--engines",
            "3",
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{admin_port}",
            "--story-period",
            "6",
            "--reset-every",
            "0.5",
            "--poll-interval",
            "0.2",
        ),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=clean_env(),
    )
    try:
        deadline = time.monotonic() + timeout_s
        metrics = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()
            metrics = scrape(url)
            if metrics and check(metrics):  # type: ignore[operator]
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"demo --attach {attach} never got ready: {metrics}")
        pids = children_of(proc.pid)
        if children is not None:
            assert len(pids) == children, pids
        # kill -USR1: every thread's stack in the log, and the demo keeps running.
        proc.send_signal(signal.SIGUSR1)
        dumped = time.monotonic() + 10
        while "most recent call first" not in log_path.read_text():
            assert time.monotonic() < dumped, "no stacks after SIGUSR1"
            time.sleep(0.1)
        assert proc.poll() is None and scrape(url) is not None, "SIGUSR1 stopped the demo"
        proc.send_signal(signal.SIGTERM)
        # Generous: under a full test run on 2 cores, its 3 engine processes once took >10 s.
        assert _wait_or_dump(proc, log_path, 30) == 0, log_path.read_text()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(process_alive(pid) for pid in pids):
            time.sleep(0.05)
        assert not [pid for pid in pids if process_alive(pid)], "orphaned processes"
        assert "Traceback" not in log_path.read_text()
    finally:
        terminate(proc)
        log.close()


def test_demo_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    def ready(m: dict[str, Any]) -> bool:
        up = m.get("vllm_dp_engine_up", {})
        resets = m.get("vllm_dp_prefix_cache_resets_total", {})
        connected = m.get("vllm_dp_engines_connected", {}).get(())
        return (
            len(up) == 3
            and all(v == 1.0 for v in up.values())
            and bool(resets)
            and (connected == 3.0)
        )

    # One sim-engine process per engine.
    _run_demo_until(tmp_path, "owner", ready, children=3)


def test_relay_demo_relays_every_handshake_and_stops_cleanly(tmp_path: Path) -> None:
    def ready(m: dict[str, Any]) -> bool:
        up = m.get("vllm_dp_engine_up", {})
        completed = m.get("vllm_dp_relay_handshakes_total", {}).get((("result", "completed"),))
        return len(up) == 3 and all(v == 1.0 for v in up.values()) and completed == 3.0

    _run_demo_until(tmp_path, "relay", ready)


def test_http_demo_serves_every_target_and_stops_cleanly(tmp_path: Path) -> None:
    def ready(m: dict[str, Any]) -> bool:
        up = m.get("vllm_dp_engine_up", {})
        return len(up) >= 2 and all(v == 1.0 for v in up.values())

    _run_demo_until(tmp_path, "http", ready)
