"""The socket limit follows the engine count (docs/scale.md, "When the limits are too low"), and a
process whose open-file limit is too low for it says so in one line (exit 2) instead of a
traceback."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from exporter.base.ports import free_listen_port
from exporter.client.enginecore import sockets
from exporter.client.relay.transport import RelayTransport
from exporter.error import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def test_context_socket_limit_is_raised_for_1024_engines() -> None:
    ctx = zmq.Context()
    try:
        # Owner mode: one output PULL for every engine, so libzmq's default (1,023) is plenty.
        assert sockets.sockets_needed(1024) <= ctx.get(zmq.MAX_SOCKETS)
        # Relay mode: an upstream DEALER per engine while it handshakes: not enough.
        needed = sockets.sockets_needed(1024, per_engine=RelayTransport.SOCKETS_PER_ENGINE)
        assert needed > ctx.get(zmq.MAX_SOCKETS)
        sockets.raise_max_sockets(ctx, needed)
        assert ctx.get(zmq.MAX_SOCKETS) == needed
        with pytest.raises(ConfigError, match="ZMQ sockets"):
            sockets.raise_max_sockets(ctx, int(ctx.get(zmq.SOCKET_LIMIT)) + 1)
    finally:
        ctx.term()


def _limit(soft: int, hard: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_soft_open_file_limit_is_raised_to_the_hard_limit() -> None:
    code = (
        "import resource; from exporter.client.enginecore import sockets; "
        "sockets.ensure_open_files(sockets.descriptors_needed(1024)); "
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    needed = sockets.descriptors_needed(1024)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this machine's hard limit ({hard}) is below {needed}")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: _limit(256, hard),
        check=True,
    ).stdout
    assert int(out) >= needed


def test_too_low_hard_limit_is_one_line_and_exit_2() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "exporter",
            "serve",
            "--attach",
            "owner",
            "--engine-count",
            "1024",
            "--handshake-address",
            f"tcp://127.0.0.1:{free_listen_port()}",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "off",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: _limit(512, 512),
    )
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "open files" in lines[0] and "ulimit -n" in lines[0] and "Traceback" not in lines[0]
    assert str(sockets.descriptors_needed(1024)) in lines[0]
