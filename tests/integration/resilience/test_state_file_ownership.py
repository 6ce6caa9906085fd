"""One state file belongs to one exporter, and a write that fails is seen.

Two exporters sharing a ``--state-file`` would overwrite each other's engines, and the one
restarted next would read the other's addresses: the second to start refuses, in one line
(exit 2 for ``serve``), while the first keeps its lock for its lifetime. A state-file write that
fails (the path became a directory) is counted in ``vllm_dp_state_file_writes_total`` and
logged once until it works again. Real sockets on 127.0.0.1, every wait bounded.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import aiohttp
import pytest

from exporter.base.ports import free_listen_port, free_port_range
from exporter.client.observe import counters_of
from exporter.error import ConfigError
from exporter.sim.options import SimOptions
from tests.harness.processes import PYTHON, ROOT, clean_env, run_cli, terminate
from tests.harness.scrape import metric_value
from tests.harness.service import (
    RecordingSimEngine,
    Service,
    ServiceFactory,
    make_config,
    start_service,
)
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mode", ["owner", "relay"])
async def test_a_second_exporter_on_the_same_state_file_refuses_to_start(
    tmp_path: Path, mode: str
) -> None:
    state = tmp_path / "state.json"
    relay = {"upstream_handshake_address": f"tcp://127.0.0.1:{free_listen_port()}"}
    extra = relay if mode == "relay" else {}
    first = await start_service(
        make_config(
            2, attach=mode, state_file=str(state), fixed_base_port=free_port_range(3), **extra
        )
    )
    try:
        # Another fleet's exporter, misconfigured onto the same file (other ports: no bind clash).
        with pytest.raises(ConfigError) as refused:
            await start_service(make_config(2, attach=mode, state_file=str(state), **extra))
        message = str(refused.value)
        assert "\n" not in message
        assert f"--state-file {state} is in use by another exporter" in message
        assert f"pid {os.getpid()}" in message
    finally:
        await first.stop()
    # The lock goes with the exporter that held it: the next one starts.
    again = await start_service(make_config(2, attach=mode, state_file=str(state), **extra))
    await again.stop()


@pytest.mark.slow
async def test_a_second_serve_process_on_the_same_state_file_exits_2_with_one_line(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.json"
    listen = free_listen_port()

    def args(port: int) -> list[str]:
        return [
            "--log-level", "warning", "serve", "--engine-count", "1",
            "--handshake-address", f"tcp://127.0.0.1:{free_listen_port()}",
            "--listen", f"127.0.0.1:{port}", "--admin-listen", "off",
            "--state-file", str(state),
        ]  # fmt: skip

    first = subprocess.Popen(
        [PYTHON, "-m", "exporter", *args(listen)],
        cwd=ROOT,
        env={**clean_env(), "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

            async def healthy() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{listen}/healthz") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = time.monotonic() + 15
            while not await healthy():
                assert first.poll() is None, "the first exporter exited"
                assert time.monotonic() < deadline, "the first exporter never answered /healthz"
                await asyncio.sleep(0.1)
        code, _, err = await run_cli(*args(free_listen_port()), timeout_s=15)
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, err
        assert len(lines) == 1, lines
        assert f"--state-file {state} is in use by another exporter (pid {first.pid}" in lines[0]
        assert first.poll() is None, "the refused start must not disturb the first exporter"
    finally:
        await asyncio.to_thread(terminate, first)


async def _writes(service: Service, outcome: str) -> float:
    value = metric_value(await service.scrape(), "vllm_dp_state_file_writes_total", outcome=outcome)
    assert value is not None, f"no {outcome} series"
    return value


def counted(service: Service) -> Mapping[str, int]:
    """The state-file writes the client counts of its own, by outcome."""
    return counters_of(service.exporter.client.observations)["vllm_dp_state_file_writes_total"]


async def test_failed_state_file_writes_are_counted_and_logged_once(
    service_factory: ServiceFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state.json"
    service = await service_factory(2, start=True, state_file=str(state))
    await eventually(lambda: state.is_file(), 5, "a first write")
    await eventually(lambda: counted(service)["ok"] >= 1, 5, "counted")
    assert await _writes(service, "failed") == 0
    ok = await _writes(service, "ok")
    assert ok >= 1

    state.unlink()
    state.mkdir()  # every write from now on fails (rename onto a directory)
    caplog.clear()
    for engine, task in zip(list(service.engines), list(service.engine_tasks), strict=True):
        failed = counted(service)["failed"]
        engine.options.dead_after_calls = engine.calls + 1  # its death is written down (tried)
        await eventually(task.done, 5, "the engine's death")
        more = partial(lambda f: counted(service)["failed"] > f, failed)
        await eventually(more, 5, "a failed write")
    assert await _writes(service, "failed") >= 2
    assert await _writes(service, "ok") == ok
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and "cannot write state file" in r.getMessage()
    ]
    assert len(errors) == 1, errors
    assert str(state) in errors[0]

    # Writable again: the next change is written, counted, and the recovery said once.
    state.rmdir()
    caplog.set_level(logging.INFO, logger="exporter.transport")
    engine = RecordingSimEngine(
        service.config.handshake_address, 0, SimOptions(), context=service.context
    )
    service.engines.append(engine)
    service.engine_tasks.append(asyncio.create_task(engine.run()))
    await eventually(lambda: state.is_file(), 5, "a write after the recovery")
    await eventually(lambda: counted(service)["ok"] > ok, 5, "counted")
    assert await _writes(service, "ok") > ok
    assert sum("written again" in r.getMessage() for r in caplog.records) == 1
