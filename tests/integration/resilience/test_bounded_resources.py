"""Case 6: bounded pending calls, per-engine state and label sets under a flapping engine; no
task or file-descriptor leaks across a whole service's start and stop."""

from __future__ import annotations

import asyncio
import os

import pytest
import zmq.asyncio

from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import connected_count
from exporter.control.runtime import Exporter
from exporter.sim.engine import SimEngine
from exporter.sim.options import SimOptions
from tests.harness.processes import SimProcess, sim_processes
from tests.harness.service import make_config, start_service
from tests.harness.waiting import eventually

POLLS = 2000


async def test_a_flapping_engine_over_thousands_of_polls_stays_bounded() -> None:
    """Engine 1 alternates between answering, failing ("Server shutting down") and
    hanging. After every poll no call is pending; label sets and per-engine state stay small."""
    config = make_config(2, call_timeout=0.005, poll_interval=5.0)
    exporter = Exporter(config)
    client = exporter.client
    assert isinstance(client, EngineCoreClient)
    ctx = zmq.asyncio.Context()
    await client.start()
    engines = [SimEngine(config.handshake_address, i, SimOptions(), context=ctx) for i in range(2)]
    tasks = [asyncio.create_task(e.run()) for e in engines]
    try:
        await eventually(lambda: connected_count(client) == 2, what="handshakes")
        flapper = engines[1].options
        label_sizes = []
        for n in range(POLLS):
            phase = n % 8
            flapper.hang = phase == 7
            engines[1].shutting_down = phase in (3, 4)
            await exporter.poller.poll_once()
            assert client.pending_count == 0, f"poll {n}: calls left pending"
            if n % 500 == 499:
                label_sizes.append(len(exporter.stats.utility_calls))
        stats = exporter.stats
        outcomes = {o for (_, _, o) in stats.utility_calls}
        assert {"ok", "failed", "timeout"} <= outcomes
        # 4 methods x 2 engines x at most 5 outcomes, whatever the number of polls.
        assert len(stats.utility_calls) <= 40
        # Bounded, not growing with the number of polls (a 5 ms timeout under CI load may add a
        # timeout series for the healthy engine late, so only the bound is asserted).
        assert max(label_sizes) <= 40
        methods = {labels[0] for labels, _, _ in stats.call_durations.rows()}
        assert methods == {"is_sleeping", "is_scheduler_paused", "get_weight_version", "has_work"}
        assert set(exporter.faults.counts) <= {"unknown_call_id"}, exporter.faults.counts
        assert len(exporter.poller._last_success) <= 2
        assert stats.polls == POLLS
        assert exporter.poller.snapshot.poll_number == POLLS
    finally:
        for e in engines:
            e.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        await client.close()
        ctx.term()


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.slow
async def test_no_task_or_fd_leaks_across_a_service_lifetime() -> None:
    config = make_config(2, poll_interval=0.1, call_timeout=0.3)
    address = config.handshake_address
    with sim_processes(SimProcess(address, 0), SimProcess(address, 1)):
        await asyncio.sleep(0.05)
        tasks_before = len(asyncio.all_tasks())
        fds_before = open_fds()
        svc = await start_service(config)
        await eventually(lambda: connected_count(svc.client) == 2, 10, "handshakes")
        await svc.ready()
        await svc.next_polls(3)
        assert svc.admin_url is not None
        families = await svc.scrape()
        assert "vllm_dp_engine_up" in families
        async with svc.session.post(svc.admin_url + "/admin/reset_prefix_cache") as resp:
            assert resp.status == 200
        assert len(asyncio.all_tasks()) > tasks_before
        await svc.stop()
        await asyncio.sleep(0)

        def back_to_baseline() -> bool:
            return len(asyncio.all_tasks()) == tasks_before and open_fds() <= fds_before

        await eventually(back_to_baseline, 3, "tasks and fds back to the baseline")
