"""Stopping the service while a client keeps calling the admin listener (the demo's trainer,
a script in a loop) and an engine never answers: ``RunningService.stop()`` ends within
seconds (the in-flight action's grace, then at most one second for the rest), over real HTTP
against the real listeners (``exporter.web.app``) and a simulated engine on real ZMQ."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import zmq.asyncio

from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from exporter.sim.engine import SimEngine
from exporter.sim.options import SimOptions
from exporter.web.app import start_service
from tests.harness.service import make_config
from tests.harness.waiting import eventually

#: Far below aiohttp's own default shutdown timeout (60 s), above grace + 1 s + a poll.
STOP_BOUND_S = 15.0


async def test_a_client_calling_in_a_loop_does_not_hold_the_stop() -> None:
    config = make_config(
        1,
        listen=f"127.0.0.1:{free_listen_port()}",
        admin_listen="127.0.0.1:0",
        poll_interval=0.2,
        call_timeout=30.0,  # the hung engine's calls outlive the stop
        reset_min_interval=0.0,
        shutdown_grace=1.0,
    )
    service = await start_service(config)
    context = zmq.asyncio.Context()
    engine = SimEngine(config.handshake_address, 0, SimOptions(hang=True), context=context)
    engine_task = asyncio.ensure_future(engine.run())
    asked: list[float] = []

    async def trainer() -> None:
        """One kept-alive session, one reset after another, each with its own Idempotency-Key
        (as ``exporter.remote`` sends them: the action then runs shielded from the client)."""
        async with aiohttp.ClientSession() as session:
            while True:
                asked.append(time.monotonic())
                key = {"Idempotency-Key": f"reset-{len(asked)}"}
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.post(
                        f"{service.admin_url}/admin/reset_prefix_cache", headers=key
                    ):
                        pass
                await asyncio.sleep(0.05)

    task = asyncio.ensure_future(trainer())
    try:
        await eventually(lambda: connected_count(service.exporter.client) == 1, 10, "handshake")
        await eventually(lambda: len(asked) >= 1, 10, "a reset in flight")
        await asyncio.sleep(0.5)
        started = time.monotonic()
        await asyncio.wait_for(service.stop(), 90)
        took = time.monotonic() - started
        assert took < STOP_BOUND_S, f"stop took {took:.1f} s with a client calling"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        engine.stop()
        await asyncio.wait_for(asyncio.gather(engine_task, return_exceptions=True), 10)
        context.term()
