"""A real Prometheus server for the end-to-end deploy tests, and bounded waits on its API."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def start_prometheus(binary: str, tmp: Path, port: int) -> subprocess.Popen[bytes]:
    """Prometheus with ``tmp/prometheus.yml``, its data in ``tmp/data``, on 127.0.0.1:port."""
    return subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        cwd=tmp,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_for(
    check: Any, timeout_s: float, what: str, explain: Callable[[], str] | None = None
) -> Any:
    """Poll ``check`` until it returns something true; on timeout fail with the last answer and
    what ``explain`` tells about the system under test then (its own state, its log)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(0.5)
    detail = f"\n{explain()}" if explain is not None else ""
    pytest.fail(f"timed out waiting for {what}; last: {last!r}{detail}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def instant_query(prometheus: str, expr: str) -> list[Any]:
    """The result vector of an instant query against the Prometheus at ``prometheus``."""
    q = urllib.parse.urlencode({"query": expr})
    body = http_json(f"{prometheus}/api/v1/query?{q}")
    assert body["status"] == "success", body
    return list(body["data"]["result"])
