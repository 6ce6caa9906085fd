"""Case 4: a restarted exporter on fixed ports reattaches to running engines without a new
handshake, recovers per-engine state within a poll and counts stale replies."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import pytest

from exporter.base.ports import free_listen_port, free_port_range
from exporter.client.fleet import Outcome, connected_count
from tests.harness.processes import SimProcess, sim_processes
from tests.harness.restart import answering
from tests.harness.scrape import metric_value as metric
from tests.harness.service import make_config, start_service
from tests.harness.waiting import eventually


async def test_a_reattachable_engine_not_yet_connected_is_disconnected_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Fixed ports, no engine connected yet: the send is refused (EHOSTUNREACH) and the call
    reports DISCONNECTED at once instead of waiting for its timeout (regression: the error
    was left on an unretrieved zmq.asyncio Future)."""
    config = make_config(2, fixed_base_port=free_port_range(3), poll_interval=5.0)
    svc = await start_service(config)
    try:
        started = time.monotonic()
        outcomes = await svc.client.call_utility("is_sleeping", timeout_s=2.0)
        assert time.monotonic() - started < 1.5  # its timeout is 2 s: not waited for
        assert [o.outcome for o in outcomes] == [Outcome.DISCONNECTED] * 2
        assert svc.client.pending_count == 0
    finally:
        await svc.stop()


@pytest.mark.slow
async def test_a_restarted_exporter_reattaches_on_fixed_ports(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = free_port_range(3)
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    settings = dict(
        fixed_base_port=base,
        handshake_address=handshake,
        poll_interval=0.1,
        poll_jitter=0.0,
        call_timeout=0.5,
    )
    engines = (
        SimProcess(handshake, 0, "--reply-delay", "0.1"),
        SimProcess(handshake, 1, "--reply-delay", "0.1", "--sleeping"),
    )
    with sim_processes(*engines):
        first = await start_service(make_config(2, **settings))
        try:
            await eventually(lambda: connected_count(first.client) == 2, 10, "handshakes")
            await first.ready()
            assert [e.sleeping for e in first.exporter.poller.snapshot.engines] == [False, True]
            # Stop while calls are in flight: their replies will reach the next exporter.
            await eventually(lambda: first.client.pending_count >= 2, 3, "calls in flight")
            await asyncio.sleep(0.02)
        finally:
            await first.stop()
        second = await start_service(make_config(2, **settings))
        try:
            restarted = time.monotonic()
            await eventually(lambda: answering(second), 3, "reattach without handshake")
            # Within one poll of the reattach, the per-engine state is back.
            await second.next_polls(2)
            snap = second.exporter.poller.snapshot
            assert [e.up for e in snap.engines] == [True, True]
            assert [e.sleeping for e in snap.engines] == [False, True]
            assert time.monotonic() - restarted < 3.0
            status = await second.status()
            assert [e["handshakes"] for e in status["engines"]] == [0, 0], "no new handshake"
            await eventually(
                lambda: second.exporter.faults.counts.get("unknown_call_id", 0) >= 1,
                2,
                "stale replies counted",
            )
            families = await second.scrape()
            stale = metric(families, "vllm_dp_protocol_errors_total", kind="unknown_call_id")
            assert stale is not None and stale >= 1
            assert metric(families, "vllm_dp_engine_up", engine="1") == 1.0
        finally:
            await second.stop()
    never_retrieved = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never_retrieved


@pytest.mark.slow
async def test_restarted_owner_remembers_what_engines_registered(tmp_path: Path) -> None:
    """Engines register their vLLM version once, at their handshake; a restarted exporter on
    fixed ports with a state file still knows it (vllm_dp_engine_info stays)."""
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    settings = dict(
        fixed_base_port=free_port_range(3),
        handshake_address=handshake,
        state_file=str(tmp_path / "state.json"),
        poll_interval=0.1,
        call_timeout=0.5,
    )
    engines = (
        SimProcess(handshake, 0, "--vllm-version", "0.32.9"),
        SimProcess(handshake, 1, "--vllm-version", "0.32.9"),
    )
    with sim_processes(*engines):
        first = await start_service(make_config(2, **settings))
        try:
            await eventually(lambda: connected_count(first.client) == 2, 10, "handshakes")
        finally:
            await first.stop()
        second = await start_service(make_config(2, **settings))
        try:
            await eventually(lambda: answering(second), 3, "reattached")
            await second.next_polls(2)
            families = await second.scrape()
            for engine in ("0", "1"):
                info = metric(families, "vllm_dp_engine_info", engine=engine, vllm_version="0.32.9")
                assert info == 1.0, engine
            status = await second.status()
            assert [e["handshakes"] for e in status["engines"]] == [0, 0]
        finally:
            await second.stop()


async def test_a_fixed_port_still_held_a_moment_is_waited_for_then_refused() -> None:
    """A restarted exporter's fixed ports can still be held briefly by the listener it replaces
    (libzmq closes sockets on its I/O thread): start waits for them, a bounded time, instead of
    failing at once; a port held for good still fails start with the address it could not bind."""
    base = free_port_range(3)
    held = socket.socket()
    held.bind(("127.0.0.1", base + 1))  # the first engine's output port
    held.listen()
    loop = asyncio.get_running_loop()
    loop.call_later(0.4, held.close)
    svc = await start_service(make_config(2, fixed_base_port=base, poll_interval=5.0))
    try:
        assert [link.output_address for link in svc.client.transport.link_snapshots()] == [
            f"tcp://127.0.0.1:{base + 1}",
            f"tcp://127.0.0.1:{base + 2}",
        ]
    finally:
        await svc.stop()
    with socket.socket() as forever:
        forever.bind(("127.0.0.1", base + 2))
        forever.listen()
        started = time.monotonic()
        with pytest.raises(Exception) as raised:
            await start_service(make_config(2, fixed_base_port=base, poll_interval=5.0))
        assert f":{base + 2}" in str(raised.value) and "in use" in str(raised.value)
        assert time.monotonic() - started < 30
