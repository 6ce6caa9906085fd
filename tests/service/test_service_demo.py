"""Issue 3: ``vllm-dp-exporter demo`` as a real process tree: it serves, its metrics move, and
SIGTERM stops it cleanly (exit 0, no orphaned engine processes)."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families
from service_support import (
    ROOT,
    children_of,
    clean_env,
    process_alive,
    python_cmd,
    terminate,
)

from exporter.ports import free_port


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


def test_demo_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    port, admin_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "demo.log").open("w+b")
    proc = subprocess.Popen(
        python_cmd(
            "--log-level",
            "warning",
            "demo",
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
        deadline = time.monotonic() + 20
        metrics = None
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "demo.log").read_text()
            metrics = scrape(url)
            if metrics:
                up = metrics.get("vllm_dp_engine_up", {})
                resets = metrics.get("vllm_dp_prefix_cache_resets_total", {})
                if len(up) == 3 and all(v == 1.0 for v in up.values()) and resets:
                    break
            time.sleep(0.2)
        else:
            raise AssertionError(f"demo never got 3 engines up: {metrics}")
        assert metrics["vllm_dp_engines_connected"][()] == 3.0
        engines = children_of(proc.pid)
        assert len(engines) == 3, engines  # one sim-engine process per engine

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 0, (tmp_path / "demo.log").read_text()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(process_alive(pid) for pid in engines):
            time.sleep(0.05)
        orphans = [pid for pid in engines if process_alive(pid)]
        assert not orphans, f"engine processes outlived the demo: {orphans}"
        text = (tmp_path / "demo.log").read_text()
        assert "Traceback" not in text, text
    finally:
        terminate(proc)
        log.close()
