"""Case 8: SIGTERM during an admin reset: the reset still answers, the process exits 0 within
5 s and leaves no socket bound."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from exporter.base.ports import free_listen_port, free_port_range
from tests.harness.processes import PYTHON, ROOT, SimProcess, can_bind, sim_processes

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow


async def test_sigterm_during_a_reset_drains_and_exits_cleanly() -> None:
    hs_port, listen, admin = free_listen_port(), free_listen_port(), free_listen_port()
    base = free_port_range(3)
    handshake = f"tcp://127.0.0.1:{hs_port}"
    args = [
        PYTHON, "-m", "exporter", "--log-level", "warning", "serve",
        "--attach", "owner", "--engine-count", "2", "--handshake-address", handshake,
        "--fixed-base-port", str(base),
        "--listen", f"127.0.0.1:{listen}", "--admin-listen", f"127.0.0.1:{admin}",
        "--poll-interval", "5", "--poll-jitter", "0", "--call-timeout", "3",
        "--reset-min-interval", "0", "--shutdown-grace", "3",
    ]  # fmt: skip
    engines = [SimProcess(handshake, i, "--reply-delay", "0.5") for i in range(2)]
    exporter = subprocess.Popen(
        args,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        with sim_processes(*engines):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as http:
                deadline = time.monotonic() + 15
                while True:
                    try:
                        async with http.get(f"http://127.0.0.1:{listen}/readyz") as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientConnectionError:
                        pass
                    assert time.monotonic() < deadline, "exporter never became ready"
                    assert exporter.poll() is None, (
                        exporter.stderr.read() if exporter.stderr else ""
                    )
                    await asyncio.sleep(0.1)
                # Let the start-up polls (two 0.5 s calls per engine) drain first.
                await asyncio.sleep(1.2)

                async def reset() -> tuple[int, dict[str, object]]:
                    url = f"http://127.0.0.1:{admin}/admin/reset_prefix_cache"
                    async with http.post(url) as resp:
                        return resp.status, await resp.json()

                started = time.monotonic()
                pending = asyncio.create_task(reset())
                await asyncio.sleep(0.25)
                assert not pending.done(), "the reset should still be in flight"
                exporter.send_signal(signal.SIGTERM)
                termed = time.monotonic()
                status, body = await asyncio.wait_for(pending, 6)
                assert status == 200 and body["success"] is True, body
                assert time.monotonic() - started >= 0.5
                code = await asyncio.to_thread(exporter.wait, 6)
                exited = time.monotonic() - termed
                assert code == 0
                assert exited < 5.0, exited
        for port in (hs_port, listen, admin, base, base + 1, base + 2):
            assert can_bind(port), f"port {port} still bound after exit"
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait(5)
        if exporter.stderr is not None:
            exporter.stderr.close()
