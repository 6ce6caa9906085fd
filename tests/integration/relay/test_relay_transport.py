"""Relay mode end to end: simulated stock front end ⇄ relay exporter ⇄ simulated engines."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from exporter.base.ports import free_port_range
from exporter.client.enginecore.links import Phase
from exporter.client.fleet import Outcome
from exporter.control.runtime import Exporter
from exporter.protocol import decode_handshake_message, encode_init
from exporter.protocol.relay import append_client_slot, strip_client_slot
from exporter.sim.engine import SimEngine
from exporter.sim.options import SimOptions
from tests.harness.relay import MakeHarness, RelayHarness, cross_talk
from tests.harness.waiting import eventually
from tests.harness.wire import vector

pytestmark = pytest.mark.timeout(10)


async def _exporter_calls(harness: RelayHarness, duration_s: float) -> list[list[Outcome]]:
    rounds = []
    deadline = time.monotonic() + duration_s
    while time.monotonic() < deadline:
        outcomes = await harness.relay.call("is_sleeping", timeout_s=1.0)
        rounds.append([o.outcome for o in outcomes])
        await asyncio.sleep(0.01)
    return rounds


@pytest.mark.parametrize("engine_count", [1, 3])
async def test_relay_concurrent_calls_without_cross_talk(
    make_harness: MakeHarness, engine_count: int
) -> None:
    h: RelayHarness = make_harness(engine_count)
    await h.start_frontend()
    relay = await h.start_relay()
    engines = h.start_engines()
    await h.wait_handshakes()
    transport = relay.transport
    fe_ok_before = h.fe.ok_count()
    rounds = await _exporter_calls(h, 0.8)
    assert len(rounds) >= 10
    assert all(r == [Outcome.OK] * engine_count for r in rounds)
    # Both clients were answered, on their own sockets, concurrently.
    for i in range(engine_count):
        assert h.fe.ok_count(i) - fe_ok_before >= 5
    assert all(o.outcome is Outcome.OK for o in h.fe.outcomes)
    assert cross_talk(relay.faults) == {}
    assert cross_talk(h.fe.faults) == {}
    assert relay.client.pending_count == 0
    assert relay.handshakes == {"completed": engine_count}
    assert transport.connected_count() == engine_count
    fe_links = {v.engine_index: v for v in h.fe.transport.link_snapshots()}
    for i, engine in enumerate(engines):
        assert transport.client_index(i) == 1
        # HELLO and READY reached the front end exactly once, byte for byte.
        assert h.fe.hello_count(i) == 1 and h.fe.ready_count(i) == 1
        assert h.fe.payloads(i, "HELLO") == [vector("hello_headless")]
        assert h.fe.payloads(i, "READY") == [vector("ready_headless")]
        # The engine got the front end's INIT with exactly the exporter's pair appended.
        upstream, forwarded = transport.init_frames(i)
        assert upstream == encode_init([h.fe.transport.input_address], [fe_links[i].output_address])
        assert forwarded is not None and upstream is not None
        assert (
            forwarded
            == append_client_slot(
                upstream, transport.input_address, transport.link_snapshots()[i].output_address
            )[0]
        )
        assert strip_client_slot(forwarded, 1) == upstream
        assert engine.init_addresses == (
            [h.fe.transport.input_address, transport.input_address],
            [fe_links[i].output_address, transport.link_snapshots()[i].output_address],
        )
    # Per-engine output addresses: each engine's exporter slot has its own address.
    assert len({v.output_address for v in transport.link_snapshots()}) == engine_count


async def test_exporter_closed_after_handshake_front_end_unaffected(
    make_harness: MakeHarness,
) -> None:
    h: RelayHarness = make_harness(2)
    await h.start_frontend()
    relay = await h.start_relay()
    h.start_engines()
    await h.wait_handshakes()
    assert (await relay.call())[0].outcome is Outcome.OK
    await relay.client.close()
    h.relays.clear()
    before = len(h.fe.outcomes)
    await eventually(lambda: len(h.fe.outcomes) - before >= 20, 5.0, "front end calls")
    after = h.fe.outcomes[before:]
    assert all(o.outcome is Outcome.OK for o in after)
    assert max(o.duration_s or 0.0 for o in after) < 0.5
    assert cross_talk(h.fe.faults) == {}
    assert all(not e.options.dead_after_calls and e.output_alive for e in h.engines)


async def test_exporter_restart_on_fixed_addresses_with_state_file(
    make_harness: MakeHarness,
) -> None:
    h: RelayHarness = make_harness(3)
    base = free_port_range(4)
    state_file = h.tmp_path / "relay-state.json"
    opts = {"fixed_base_port": base, "state_file": str(state_file)}
    await h.start_frontend()
    relay1 = await h.start_relay(**opts)
    h.start_engines({i: SimOptions(reply_delay_s=0.05) for i in range(3)})
    await h.wait_handshakes()
    # Written in the background, within a write or two of the last READY.
    await eventually(
        lambda: state_file.exists() and len(json.loads(state_file.read_text())["engines"]) == 3,
        what="three engines in the state file",
    )
    state = json.loads(state_file.read_text())
    assert state["input_address"] == f"tcp://127.0.0.1:{base}"
    assert [(e["engine_index"], e["client_index"]) for e in state["engines"]] == [
        (0, 1),
        (1, 1),
        (2, 1),
    ]
    assert [e["output_address"] for e in state["engines"]] == [
        f"tcp://127.0.0.1:{base + 1 + i}" for i in range(3)
    ]
    assert all(o.outcome is Outcome.OK for o in await relay1.call())
    # A call in flight when the exporter dies: its reply goes to the next process.
    in_flight = asyncio.create_task(relay1.client.call_utility("is_sleeping", timeout_s=2.0))
    await asyncio.sleep(0.01)
    await relay1.client.close()
    in_flight.cancel()
    await asyncio.gather(in_flight, return_exceptions=True)

    relay2 = await h.start_relay(**opts)
    t2 = relay2.transport
    # Callable at once, without a new handshake; connected once their connections are back.
    assert all(t2.is_callable(i) and t2.phase(i) is Phase.RESTORED for i in range(3))
    assert [t2.client_index(i) for i in range(3)] == [1, 1, 1]
    poll_interval = 0.5
    outcomes = await relay2.call(timeout_s=poll_interval)
    if not all(o.outcome is Outcome.OK for o in outcomes):  # ZMQ reconnect not done yet
        await asyncio.sleep(poll_interval)
        outcomes = await relay2.call(timeout_s=poll_interval)
    assert [o.outcome for o in outcomes] == [Outcome.OK] * 3
    assert t2.connected_count() == 3
    await eventually(lambda: relay2.faults.counts.get("unknown_call_id", 0) >= 1, 2.0, "stale")
    assert relay2.handshakes == {}
    assert all(h.fe.hello_count(i) == 1 and h.fe.ready_count(i) == 1 for i in range(3))
    assert all(v.handshakes == 0 for v in t2.link_snapshots())
    assert cross_talk(h.fe.faults) == {}


async def test_engine_death_seen_by_both_and_attributed(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(3)
    await h.start_frontend()
    relay = await h.start_relay()
    h.start_engines({1: SimOptions(dead_after_calls=8)})
    await h.wait_handshakes()
    await eventually(lambda: relay.transport.phase(1) is Phase.DEAD, 5.0, "engine 1 dead")
    await eventually(lambda: h.fe.dead(1), 2.0, "front end sees engine 1 dead")
    links = {v.engine_index: v for v in relay.transport.link_snapshots()}
    assert [links[i].dead for i in range(3)] == [False, True, False]
    assert not h.fe.dead(0) and not h.fe.dead(2)
    outcomes = await relay.call()
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.DISCONNECTED, Outcome.OK]
    assert relay.transport.connected_count() == 2


async def test_upstream_late(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(3)
    relay = await h.start_relay()
    h.start_engines()
    await eventually(
        lambda: all(relay.transport.phase(i) is Phase.HELLO_SENT for i in range(3)),
        5.0,
        "every HELLO relayed to the absent front end",
    )
    assert relay.transport.connected_count() == 0
    assert [o.outcome for o in await relay.call()] == [Outcome.DISCONNECTED] * 3
    await h.start_frontend()
    await h.wait_handshakes()
    assert all(o.outcome is Outcome.OK for o in await relay.call())
    assert all(h.fe.hello_count(i) == 1 and h.fe.ready_count(i) == 1 for i in range(3))
    assert relay.handshakes == {"completed": 3}


async def test_upstream_timeout_is_counted_and_never_replayed(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(1)
    relay = await h.start_relay()
    relay.transport.config.upstream_timeout_s = 0.3
    h.start_engine(0, SimOptions(handshake_timeout_s=5.0))
    await eventually(lambda: relay.handshakes["upstream_timeout"] == 1, 3.0, "upstream timeout")
    assert relay.transport.phase(0) is Phase.IDLE
    # The dropped HELLO is not delivered when the front end appears later.
    await h.start_frontend(call_loop=False)
    await asyncio.sleep(0.5)
    assert h.fe.hello_count(0) == 0


async def test_unknown_identity_is_counted_not_forwarded(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(2)
    await h.start_frontend()
    relay = await h.start_relay()
    h.start_engines()
    stranger = SimEngine(h.relay_address, 7, SimOptions(handshake_timeout_s=5.0))
    task = asyncio.create_task(stranger.run())
    try:
        await h.wait_handshakes()
        await eventually(
            lambda: relay.faults.counts.get("unknown_identity", 0) >= 1, 3.0, "unknown identity"
        )
        assert h.fe.transport.received[(b"\x07\x00", "HELLO")] == 0
        assert relay.handshakes == {"completed": 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_init_rewrite_refused_forwards_unchanged(make_harness: MakeHarness) -> None:
    """A front end whose INIT is not canonical: forwarded as is, engine not served by us."""
    h: RelayHarness = make_harness(1)
    relay = await h.start_relay()
    # A valid INIT whose data_parallel_size 2 is written as uint16 (cd 0002), not fixint.
    canonical = encode_init(
        ["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:10"], {"data_parallel_size": 2}
    )
    odd_init = canonical.replace(
        b"\xb2data_parallel_size\x02", b"\xb2data_parallel_size\xcd\x00\x02"
    )
    assert odd_init != canonical
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(h.frontend_address)
    try:
        engine = h.start_engine(0, SimOptions(handshake_timeout_s=5.0))
        identity, hello = await asyncio.wait_for(router.recv_multipart(), 3.0)
        assert identity == b"\x00\x00" and hello == vector("hello_headless")
        await router.send_multipart([identity, odd_init])
        identity, ready = await asyncio.wait_for(router.recv_multipart(), 3.0)
        assert decode_handshake_message(ready).status == "READY"
        assert relay.transport.init_frames(0) == (odd_init, odd_init)
        assert engine.init_addresses == (["tcp://127.0.0.1:9"], ["tcp://127.0.0.1:10"])
        assert relay.handshakes == {"init_rewrite_refused": 1}
        assert relay.faults.counts.get("init_not_canonical") == 1
        assert not relay.transport.is_callable(0)
        assert [o.outcome for o in await relay.call()] == [Outcome.DISCONNECTED]
        # Nothing else is sent upstream: no retry, no replay.
        assert not await router.poll(200)
    finally:
        router.close(linger=0)
        ctx.term()


async def test_engine_restart_relayed_again(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(2)
    await h.start_frontend()
    relay = await h.start_relay()
    h.start_engines()
    await h.wait_handshakes()
    old = h.engines[0]
    old.stop()
    await asyncio.wait_for(h.engine_tasks[0], 3.0)
    h.start_engine(0)
    await eventually(lambda: h.fe.ready_count(0) == 2, 5.0, "second READY at the front end")
    await relay.transport.wait_connected(3.0)
    assert h.fe.hello_count(0) == 2 and h.fe.hello_count(1) == 1
    assert relay.handshakes == {"completed": 3}
    assert [v.handshakes for v in relay.transport.link_snapshots()] == [2, 1]
    outcomes = await relay.call()
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.OK]


async def test_exporter_runtime_readiness_and_metric(make_harness: MakeHarness) -> None:
    h: RelayHarness = make_harness(2)
    await h.start_frontend()
    exporter = Exporter(h.serve_config(poll_interval=0.2, call_timeout=0.5, poll_jitter=0.0))
    await exporter.start()
    try:
        h.start_engines()
        await eventually(lambda: exporter.poller.snapshot.ready, 5.0, "exporter ready")
        text = generate_latest(exporter.registry).decode()
        assert 'vllm_dp_relay_handshakes_total{result="completed"} 2.0' in text
        assert cross_talk(exporter.faults) == {}
    finally:
        await exporter.stop()
