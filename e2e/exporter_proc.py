"""The exporter under test, driven only as a user would: its CLI and its HTTP endpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import web
from e2e.ports import HOST, free_port
from e2e.procs import Managed, ProcessGroup, cli_flags, first_exited

STARTUP_TIMEOUT_S = 30.0
# Poll every second; a call that gets no answer in 5 s is a timeout. Resets may follow each
# other at once (the suite sends several in a row on purpose). GET /gate answers callers within
# GATE_MIN_INTERVAL_S of its last fan-out from that fan-out (the exporter's default, made
# explicit: scenario 7 waits it out after an action, see docs/e2e.md).
GATE_MIN_INTERVAL_S = 0.2
COMMON_FLAGS = cli_flags(
    poll_interval=1, call_timeout=5, reset_min_interval=0, gate_min_interval=GATE_MIN_INTERVAL_S
)


@dataclass
class ExporterProc:
    """A running ``python -m exporter serve`` and the URLs it serves."""

    proc: Managed
    listen_port: int
    admin_port: int

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.listen_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{HOST}:{self.admin_port}"

    def scrape(self) -> web.Scrape:
        reply = web.get(f"{self.url}/metrics")
        assert reply.status == 200, reply
        return web.Scrape(reply.body.decode())

    def status(self) -> dict[str, Any]:
        reply = web.get(f"{self.url}/status")
        assert reply.status == 200, reply
        body: dict[str, Any] = reply.json()
        return body

    def readyz(self) -> int | None:
        return web.answers(f"{self.url}/readyz")

    def reset(self, reset_running_requests: bool = False) -> web.Reply:
        flag = "true" if reset_running_requests else "false"
        return web.post(
            f"{self.admin_url}/admin/reset_prefix_cache?reset_running_requests={flag}",
            timeout_s=30.0,
        )

    def admin(self, action: str, payload: Any = None, **query: str) -> web.Reply:
        """``POST /admin/<action>[?query]`` with ``payload`` as its JSON body (none if None)."""
        url = f"{self.admin_url}/admin/{action}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        return web.post(url, payload, timeout_s=60.0)

    def gate(self, **conditions: str) -> web.Reply:
        """``GET /gate?conditions`` (a fresh fan-out of every invariant on every engine)."""
        return web.get(f"{self.url}/gate?{urllib.parse.urlencode(conditions)}", timeout_s=30.0)

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``vllm-dp-exporter ctl ARGS`` (bounded), for the exit-code contract."""
        return subprocess.run(
            [sys.executable, "-m", "exporter", "ctl", *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def wait_serving(self) -> None:
        """Until /healthz answers (the process is up; engines may still be starting)."""
        web.wait_for(
            lambda: web.answers(f"{self.url}/healthz") == 200,
            STARTUP_TIMEOUT_S,
            f"exporter {self.url}/healthz",
            abort=lambda: first_exited(self.proc),
        )

    def wait_ready(self, timeout_s: float, *watch: Managed) -> dict[str, Any]:
        """Until /readyz is 200 (every engine handshaked and answered the last poll); gives up
        early when the exporter or one of the ``watch``ed processes (the engines) exits."""
        web.wait_for(
            lambda: self.readyz() == 200,
            timeout_s,
            f"exporter {self.url}/readyz",
            interval_s=1.0,
            abort=lambda: first_exited(self.proc, *watch),
        )
        return self.status()


def start_exporter(
    group: ProcessGroup,
    name: str,
    mode_args: list[str],
    listen_port: int | None = None,
    admin_port: int | None = None,
) -> ExporterProc:
    """Start ``serve`` with ``mode_args`` on fresh (or the given, for a restart) ports."""
    listen_port = listen_port or free_port()
    admin_port = admin_port or free_port()
    argv = [
        sys.executable, "-m", "exporter", "serve", *mode_args,
        *cli_flags(listen=f"{HOST}:{listen_port}", admin_listen=f"{HOST}:{admin_port}"),
        *COMMON_FLAGS,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_")}
    exporter = ExporterProc(
        group.start(name, argv, env, cwd=Path(__file__).parents[1]), listen_port, admin_port
    )
    exporter.wait_serving()
    return exporter


def owner_args(handshake_port: int, base_port: int, count: int = 2) -> list[str]:
    return cli_flags(
        attach="owner", engine_count=count,
        handshake_address=f"tcp://{HOST}:{handshake_port}",
        advertise_host=HOST, fixed_base_port=base_port,
    )  # fmt: skip


def relay_args(
    handshake_port: int, upstream_port: int, base_port: int, state_file: Path, count: int = 2
) -> list[str]:
    return cli_flags(
        attach="relay", engine_count=count,
        handshake_address=f"tcp://{HOST}:{handshake_port}",
        upstream_handshake_address=f"tcp://{HOST}:{upstream_port}",
        advertise_host=HOST, fixed_base_port=base_port, state_file=state_file,
    )  # fmt: skip


def http_args(targets: dict[str, str]) -> list[str]:
    args = cli_flags(attach="http")
    for name, url in targets.items():
        args += cli_flags(http_target=f"{name}={url}")
    return args


def confirmed(reply: web.Reply, action: str) -> dict[str, Any]:
    """An admin action's answer: 200, a success every engine confirmed (verified by a
    read-back)."""
    body: dict[str, Any] = reply.json()
    assert reply.status == 200, body
    assert body["action"] == action and body["outcome"] == "success", body
    assert body["verified"] is True and body["failed_engines"] == [], body
    return body


def states(body: dict[str, Any]) -> list[tuple[str, bool, Any]]:
    """Each engine's (engine, ok, state read back) of an admin action's answer."""
    return [(str(e["engine"]), e["ok"], e.get("state")) for e in body["engines"]]
