"""Cases 1-3: a hung engine, a dead engine (announced and silent), a restarted engine."""

from __future__ import annotations

import asyncio
import time

import pytest

from exporter.client.fleet import Outcome, connected_count
from exporter.sim.options import SimOptions
from tests.harness.processes import SimProcess, sim_processes
from tests.harness.scrape import metric_value as metric
from tests.harness.service import ServiceFactory
from tests.harness.waiting import eventually

MARGIN_S = 0.5


async def test_hung_engines_time_out_alone_and_polls_stay_bounded(
    service_factory: ServiceFactory,
) -> None:
    """Three of five engines hang: only they time out, every poll ends within
    call_timeout + margin (one shared deadline: per-engine deadlines in sequence would take
    3 x call_timeout), and the answering engines' last-success timestamps keep advancing."""
    call_timeout = 0.3
    svc = await service_factory(5, call_timeout=call_timeout, poll_interval=0.1)
    hung = {1, 2, 3}
    await svc.start_engines(by_index={i: SimOptions(hang=True) for i in hung})
    await svc.next_polls(2)
    first = svc.exporter.poller.snapshot
    durations = []
    for _ in range(4):
        await svc.next_polls(1)
        families = await svc.scrape()
        duration = metric(families, "vllm_dp_poll_duration_seconds")
        assert duration is not None
        durations.append(duration)
        durations.append(svc.exporter.poller.snapshot.poll_duration_s)
    assert max(durations) <= call_timeout + MARGIN_S, durations
    snap = svc.exporter.poller.snapshot
    for e in snap.engines:
        assert e.sleeping_outcome is not None
        if int(e.engine) in hung:
            assert e.sleeping_outcome.outcome is Outcome.TIMEOUT
            assert e.paused_outcome is not None and e.paused_outcome.outcome is Outcome.TIMEOUT
        else:
            assert e.up and e.sleeping is False
    before = {e.engine: e.last_success_unix for e in first.engines}
    for e in snap.engines:
        if int(e.engine) not in hung:
            earlier = before[e.engine]
            assert e.last_success_unix is not None and earlier is not None
            assert e.last_success_unix > earlier
    families = await svc.scrape()
    for i in range(5):
        up = metric(families, "vllm_dp_engine_up", engine=str(i))
        assert up == (0.0 if i in hung else 1.0)
        timeouts = metric(
            families,
            "vllm_dp_utility_calls_total",
            method="is_sleeping",
            engine=str(i),
            outcome="timeout",
        )
        assert ((timeouts or 0.0) > 0) if i in hung else not timeouts, (i, timeouts)


async def test_an_announced_death_is_reported_at_once(service_factory: ServiceFactory) -> None:
    """ENGINE_CORE_DEAD: the call queued behind the fatal one fails at once (not at its 3 s
    timeout), new calls are DISCONNECTED without a send, and engine_up drops to 0 well
    within the 5 s poll interval (only the immediate poll can do that)."""
    svc = await service_factory(2, poll_interval=5.0, poll_jitter=0.0, call_timeout=0.5)
    await svc.start_engines()
    await svc.ready()
    victim = svc.engines[1]
    victim.options.reply_delay_s = 0.2
    victim.options.dead_after_calls = victim.calls + 1
    client = svc.client
    started = time.monotonic()
    fatal = asyncio.create_task(client.call_utility("is_sleeping", timeout_s=3.0))
    await asyncio.sleep(0.02)
    queued = asyncio.create_task(client.call_utility("is_scheduler_paused", timeout_s=3.0))
    outcomes = await asyncio.wait_for(queued, 2.0)
    elapsed = time.monotonic() - started
    assert outcomes[1].outcome is Outcome.DISCONNECTED, outcomes[1]
    assert outcomes[0].outcome is Outcome.OK
    assert elapsed < 1.0, f"pending call failed after {elapsed:.2f}s"
    assert [o.outcome for o in await fatal] == [Outcome.OK, Outcome.OK]
    died_at = time.monotonic()

    async def engine_up() -> float | None:
        return metric(await svc.scrape(), "vllm_dp_engine_up", engine="1")

    while (await engine_up()) != 0.0:
        assert time.monotonic() - died_at < 1.5, "engine_up still 1 long after the death"
        await asyncio.sleep(0.02)
    assert metric(await svc.scrape(), "vllm_dp_engine_up", engine="0") == 1.0
    calls = victim.calls
    again = await client.call_utility("is_sleeping", timeout_s=1.0)
    assert again[1].outcome is Outcome.DISCONNECTED and again[1].duration_s is None
    assert victim.calls == calls
    status = await svc.status()
    assert status["engines"][1]["connected"] is False


@pytest.mark.slow
async def test_a_sigkilled_engine_is_down_within_one_call_timeout(
    service_factory: ServiceFactory,
) -> None:
    """A SIGKILLed engine sends nothing: its pending call fails promptly (socket monitor),
    engine_up drops to 0 within one call timeout even with a 5 s poll interval, and /metrics
    answers throughout."""
    call_timeout = 0.5
    svc = await service_factory(2, poll_interval=5.0, poll_jitter=0.0, call_timeout=call_timeout)
    address = svc.config.handshake_address
    victim = SimProcess(address, 1, "--reply-delay", "0.05")
    with sim_processes(SimProcess(address, 0), victim):
        await eventually(lambda: connected_count(svc.client) == 2, 10, "handshakes")
        await svc.ready()
        scrape_failures: list[str] = []
        stop = asyncio.Event()

        async def scraper() -> int:
            n = 0
            while not stop.is_set():
                try:
                    async with svc.session.get(svc.url + "/metrics") as resp:
                        if resp.status != 200:
                            scrape_failures.append(str(resp.status))
                        await resp.read()
                except Exception as exc:
                    scrape_failures.append(repr(exc))
                n += 1
                await asyncio.sleep(0.02)
            return n

        scraping = asyncio.create_task(scraper())
        # A call in flight on the victim with a long timeout: the kill must end it early.
        pending = asyncio.create_task(svc.client.call_utility("is_sleeping", timeout_s=4.0))
        await asyncio.sleep(0.01)
        killed_at = time.monotonic()
        victim.kill()
        outcomes = await asyncio.wait_for(pending, 5.0)
        call_ended = time.monotonic() - killed_at
        while True:
            families = await svc.scrape()
            if metric(families, "vllm_dp_engine_up", engine="1") == 0.0:
                break
            assert time.monotonic() - killed_at < call_timeout + 0.5, "down not reported in time"
            await asyncio.sleep(0.02)
        assert metric(families, "vllm_dp_engine_up", engine="0") == 1.0
        await asyncio.sleep(0.3)
        stop.set()
        scrapes = await scraping
        assert outcomes[1].outcome in (Outcome.DISCONNECTED, Outcome.OK), outcomes[1]
        if outcomes[1].outcome is Outcome.DISCONNECTED:
            assert call_ended < 1.0, f"pending call ended {call_ended:.2f}s after the kill"
        assert scrapes > 5 and not scrape_failures, scrape_failures


@pytest.mark.slow
async def test_a_restarted_engine_handshakes_again(service_factory: ServiceFactory) -> None:
    """Kill engine 1's process and start it again: it re-handshakes on the same address and is
    reported up again (handshakes 2), without restarting the exporter."""
    svc = await service_factory(2, poll_interval=0.2, call_timeout=0.4)
    address = svc.config.handshake_address
    first = SimProcess(address, 1)
    second = SimProcess(address, 1, "--sleeping")
    with sim_processes(SimProcess(address, 0), first):
        await eventually(lambda: connected_count(svc.client) == 2, 10, "handshakes")
        await svc.ready()
        first.kill()
        await eventually(
            lambda: not svc.exporter.poller.snapshot.engines[1].up, 3, "engine 1 reported down"
        )
        with sim_processes(second):
            deadline = time.monotonic() + 10
            while True:
                status = await svc.status()
                e1 = status["engines"][1]
                sleeping = e1["invariants"]["is_sleeping"]["value"]
                if e1["up"] and e1["handshakes"] == 2 and sleeping is True:
                    break
                assert time.monotonic() < deadline, status
                await asyncio.sleep(0.05)
            families = await svc.scrape()
            assert metric(families, "vllm_dp_engine_up", engine="1") == 1.0
            assert metric(families, "vllm_dp_engine_up", engine="0") == 1.0
            assert status["engines"][0]["handshakes"] == 1
