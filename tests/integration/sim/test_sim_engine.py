"""Engine-side conformance cases 16-23: the simulated engine against a stock-like client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from exporter.base.ports import free_listen_port, ipv6_loopback
from exporter.protocol import ENGINE_CORE_DEAD, encode_init
from exporter.sim.engine import (
    COORDINATED_DP_SIZE,
    PARALLEL_CONFIG_HASH,
    SimEngine,
    SimStartupError,
)
from exporter.sim.options import SimOptions
from exporter.sim.state import PARAMETER_NAMES
from tests.harness.stockclient import StockClient
from tests.harness.waiting import eventually
from tests.harness.wire import loopback_address


class Rig:
    def __init__(self, slots: int = 1) -> None:
        self.address = loopback_address()
        self.ctx = zmq.asyncio.Context()
        self.front = StockClient(self.ctx, self.address, slots)
        self.tasks: list[asyncio.Task[str]] = []

    def engine(self, rank: int, **options: object) -> SimEngine:
        e = SimEngine(self.address, rank, SimOptions(**options), context=self.ctx)  # type: ignore[arg-type]
        self.tasks.append(asyncio.create_task(e.run()))
        return e

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.front.close()
        self.ctx.term()


@pytest.fixture
async def rig_factory() -> AsyncIterator[object]:
    rigs: list[Rig] = []

    def make(slots: int = 1) -> Rig:
        r = Rig(slots)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        await r.close()


async def test_the_engine_registers_on_every_input_before_ready(rig_factory) -> None:
    rig = rig_factory(slots=2)
    rig.engine(3)
    identity, hello = await rig.front.recv_hs()
    assert identity == b"\x03\x00"
    assert (hello.status, hello.local, hello.headless) == ("HELLO", False, True)
    await rig.front.send_init(identity)
    regs = [await rig.front.recv_registration(slot) for slot in (0, 1)]
    assert all(ident == b"\x03\x00" for ident, _ in regs)
    assert len(regs[0][1]) == 28 and regs[0][1]["data_parallel_rank"] == 3
    # Registration went out on every input before READY reached the handshake socket.
    _, ready = await rig.front.recv_hs()
    assert ready.status == "READY" and ready.headless
    await rig.front.call(3, "is_sleeping", slot=1)
    out = await rig.front.reply(slot=1)
    assert out.engine_index == 3 and out.utility.value is False


@pytest.mark.parametrize(
    "init",
    [
        {"addresses": {"inputs": [], "outputs": []}},
        {"addresses": {"inputs": [], "outputs": []}, "parallel_config": {"x": True}},
        {"addresses": {"inputs": [], "outputs": []}, "parallel_config": {"x": 0.5}},
        {"addresses": {"inputs": [], "outputs": []}, "parallel_config": {"x": None}},
        [{"inputs": [], "outputs": []}, {}],
    ],
)
async def test_an_init_the_engine_cannot_decode_aborts_its_startup(
    rig_factory, init: object
) -> None:
    rig = rig_factory()
    rig.engine(0)
    identity, _ = await rig.front.recv_hs()
    await rig.front.send_init(identity, msgspec.msgpack.encode(init))
    with pytest.raises(SimStartupError):
        await asyncio.wait_for(rig.tasks[0], 3)


async def test_unknown_init_keys_are_ignored(rig_factory) -> None:
    rig = rig_factory()
    rig.engine(0)
    identity, _ = await rig.front.recv_hs()
    init = msgspec.msgpack.decode(
        encode_init(rig.front.input_addresses, rig.front.output_addresses)
    )
    init["future"] = {"a": 1}
    init["addresses"]["future_address"] = "tcp://x"
    await rig.front.send_init(identity, msgspec.msgpack.encode(init))
    await rig.front.recv_registration(0)
    _, ready = await rig.front.recv_hs()
    assert ready.status == "READY"


async def test_replies_have_nine_positions_vllms_failure_text_and_a_wrapped_none(
    rig_factory,
) -> None:
    rig = rig_factory()
    rig.engine(1)
    await rig.front.handshake(1)
    call_id = await rig.front.call(1, "release_kv_cache_memory")
    frames = await rig.front.recv_raw()
    assert frames is not None and len(frames) == 1
    decoded = msgspec.msgpack.decode(frames[0])
    assert len(decoded) == 9 and decoded[0] == 1 and decoded[1] == []
    assert decoded[4] == [
        call_id,
        "Call to release_kv_cache_memory method failed: "
        "'EngineCoreProc' object has no attribute 'release_kv_cache_memory'",
        None,
    ]
    call_id = await rig.front.call(1, "sleep", (1,))
    decoded = msgspec.msgpack.decode((await rig.front.recv_raw())[0])
    assert decoded[4] == [call_id, None, [None, None]], "None results are still [nil, nil]"


async def test_a_reply_goes_to_the_output_of_the_requests_client_index(rig_factory) -> None:
    rig = rig_factory(slots=2)
    rig.engine(0)
    await rig.front.handshake(0)
    call_id = await rig.front.call(0, "is_sleeping", slot=0, client_index=1)
    assert await rig.front.recv_raw(slot=0, timeout_s=0.2) is None
    out = await rig.front.reply(slot=1)
    assert out.utility.call_id == call_id


async def _value(rig: Rig, method: str, args: tuple[Any, ...] = ()) -> object:
    await rig.front.call(0, method, args)
    out = await rig.front.reply()
    assert out.utility.failure_message is None, out.utility.failure_message
    return out.utility.value


async def _failure(rig: Rig, method: str, args: tuple[Any, ...] = ()) -> str:
    await rig.front.call(0, method, args)
    out = await rig.front.reply()
    return str(out.utility.failure_message)


async def test_sleep_wake_up_pause_and_reset_answer_as_vllms_do(rig_factory) -> None:
    rig = rig_factory()
    rig.engine(0)
    await rig.front.handshake(0)
    assert await _value(rig, "is_sleeping") is False
    await _value(rig, "sleep", (0,))
    assert await _value(rig, "is_sleeping") is True  # level 0: paused only
    assert await _value(rig, "is_scheduler_paused") is True
    assert await _value(rig, "wake_up", (None,)) is True
    assert await _value(rig, "is_sleeping") is False
    await _value(rig, "sleep", (1,))
    assert await _value(rig, "is_sleeping") is True
    assert await _value(rig, "wake_up", (["weights"],)) is False  # partial wake
    assert await _value(rig, "is_sleeping") is True
    assert await _value(rig, "wake_up", (None,)) is True
    await _value(rig, "pause_scheduler")
    assert await _value(rig, "is_sleeping") is True
    await _value(rig, "resume_scheduler")
    assert (
        await _failure(rig, "sleep", (1, "bogus"))
        == "Call to sleep method failed: Invalid pause mode: bogus"
    )
    for args in ((), (True,), (True, True)):
        assert await _value(rig, "reset_prefix_cache", args) is True
    assert (
        await _failure(rig, "reset_prefix_cache", (True, True, True))
        == "Call to reset_prefix_cache method failed: "
    )


async def test_a_stopping_engine_answers_shutting_down_then_exits_without_dead(rig_factory) -> None:
    rig = rig_factory()
    engine = rig.engine(0, shutdown_window_s=0.5)
    await rig.front.handshake(0)
    engine.stop()
    assert await _failure(rig, "is_sleeping") == "Server shutting down"
    assert await asyncio.wait_for(rig.tasks[0], 3) == "stopped"
    assert await rig.front.recv_raw(timeout_s=0.3) is None, "no ENGINE_CORE_DEAD on a clean exit"


async def test_a_fatal_error_sends_engine_core_dead_on_every_output(rig_factory) -> None:
    rig = rig_factory(slots=2)
    rig.engine(0, dead_after_calls=1)
    await rig.front.handshake(0)
    await rig.front.call(0, "is_sleeping")
    await rig.front.reply()
    assert await rig.front.recv_raw(slot=0) == [ENGINE_CORE_DEAD]
    assert await rig.front.recv_raw(slot=1) == [ENGINE_CORE_DEAD]
    assert await asyncio.wait_for(rig.tasks[0], 3) == "dead"


async def test_a_sleep_that_waits_for_the_drain_is_answered_after_a_later_call(rig_factory) -> None:
    rig = rig_factory()
    rig.engine(0, drain_s=0.4)
    await rig.front.handshake(0)
    sleep_id = await rig.front.call(0, "sleep", (1, "wait"))
    probe_id = await rig.front.call(0, "is_sleeping")
    first = await rig.front.reply()
    second = await rig.front.reply()
    assert [first.utility.call_id, second.utility.call_id] == [probe_id, sleep_id]


async def test_an_unknown_request_type_kills_the_input_thread(rig_factory) -> None:
    rig = rig_factory()
    engine = rig.engine(0)
    await rig.front.handshake(0)
    await rig.front.call(0, "is_sleeping", request_type=b"\x07")
    await eventually(lambda: engine.input_alive is False, 3, "the input thread died")
    await rig.front.call(0, "is_sleeping")
    assert await rig.front.recv_raw(timeout_s=0.3) is None, "the engine is a silent zombie now"


async def test_a_malformed_utility_payload_kills_the_input_thread(rig_factory) -> None:
    rig = rig_factory()
    engine = rig.engine(0)
    await rig.front.handshake(0)
    await rig.front.call(0, "x", payload=b"\x93\x00\x01\xa1x")
    await eventually(lambda: engine.input_alive is False, 3, "the input thread died")


async def test_an_out_of_range_client_index_kills_the_output_thread(rig_factory) -> None:
    rig = rig_factory()
    engine = rig.engine(0)
    await rig.front.handshake(0)
    await rig.front.call(0, "is_sleeping", client_index=5)
    await eventually(lambda: engine.output_alive is False, 3, "the output thread died")
    await rig.front.call(0, "is_sleeping")
    assert await rig.front.recv_raw(timeout_s=0.3) is None


async def test_the_executor_failed_request_type_kills_the_engine(rig_factory) -> None:
    rig = rig_factory()
    rig.engine(0)
    await rig.front.handshake(0)
    await rig.front.call(0, "is_sleeping", request_type=b"\x04")
    assert await rig.front.recv_raw() == [ENGINE_CORE_DEAD]
    assert await asyncio.wait_for(rig.tasks[0], 3) == "dead"


@pytest.mark.parametrize("coordinated", [False, True])
async def test_coordinated_dp_registration_and_ready(rig_factory, coordinated: bool) -> None:
    rig = rig_factory()
    rig.engine(2, coordinated_dp=coordinated)
    identity, _ = await rig.front.recv_hs()
    await rig.front.send_init(identity)
    _, registration = await rig.front.recv_registration(0)
    assert len(registration) == 28
    assert registration["data_parallel_size"] == (COORDINATED_DP_SIZE if coordinated else 1)
    assert registration["data_parallel_rank"] == 2
    _, ready = await rig.front.recv_hs()
    assert (ready.status, ready.local, ready.headless) == ("READY", False, True)
    if coordinated:
        assert ready.extra == {"parallel_config_hash": PARALLEL_CONFIG_HASH}
        int(PARALLEL_CONFIG_HASH, 16)  # a hex string
    else:
        assert ready.extra == {}


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")
async def test_bracketed_ipv6_addresses_enable_zmq_ipv6() -> None:
    """Handshake, input and output on tcp://[::1]:port; the engine's own context has no IPv6
    default, so it must set zmq.IPV6 per socket (as vLLM's make_zmq_socket does)."""
    front_ctx = zmq.asyncio.Context()
    front_ctx.setsockopt(zmq.IPV6, 1)
    address = f"tcp://[::1]:{free_listen_port()}"
    front = StockClient(front_ctx, address, slots=1, host="[::1]")
    engine = SimEngine(address, 0, SimOptions(handshake_timeout_s=3.0))
    task = asyncio.create_task(engine.run())
    try:
        await front.handshake(0)
        assert engine.init_addresses is not None
        inputs, outputs = engine.init_addresses
        assert all(a.startswith("tcp://[::1]:") for a in inputs + outputs)
        await front.call(0, "is_sleeping")
        assert (await front.reply()).utility.value is False
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        front.close()
        front_ctx.term()


async def test_rl_methods_over_zmq(rig_factory) -> None:
    """Weight version, cache resets and checksums through the real wire (docs/protocol.md D)."""
    rig = rig_factory()
    rig.engine(0, tp_size=2)
    await rig.front.handshake(0)
    assert await _value(rig, "get_weight_version") is None
    assert await _value(rig, "set_weight_version", ("step-7",)) is None
    assert await _value(rig, "get_weight_version") == "step-7"
    assert await _value(rig, "reset_mm_cache") is None
    assert await _value(rig, "reset_encoder_cache") is None
    workers = await _value(rig, "compute_weight_checksums")
    assert isinstance(workers, list) and len(workers) == 2
    assert all(isinstance(w, dict) and len(w) == len(PARAMETER_NAMES) for w in workers)
    assert sorted({key.split("model.")[0].split("lm_head")[0] for w in workers for key in w}) == [
        "dp0:pp0:pcp0:tp0:ep0:",
        "dp0:pp0:pcp0:tp1:ep0:",
    ]
    assert (
        await _failure(rig, "set_weight_version", ())
        == "Call to set_weight_version method failed: "
        "EngineCore.set_weight_version() missing 1 required positional argument: 'version'"
    )


async def test_checksums_across_ranks_and_a_corrupt_parameter(rig_factory) -> None:
    by_rank = {}
    for rank in (0, 1):
        rig = rig_factory()  # one front end per engine: their handshakes do not interleave
        corrupt = "lm_head.weight" if rank == 1 else None
        rig.engine(rank, weight_version="v1", corrupt_param=corrupt)
        await rig.front.handshake(rank)
        await rig.front.call(rank, "compute_weight_checksums")
        out = await rig.front.reply()
        assert out.utility.failure_message is None
        [worker] = out.utility.value
        assert all(key.startswith(f"dp{out.engine_index}:") for key in worker)
        by_rank[out.engine_index] = {k.split(":", 1)[1]: v for k, v in worker.items()}
    differ = [k for k in by_rank[0] if by_rank[0][k] != by_rank[1][k]]
    assert differ == ["pp0:pcp0:tp0:ep0:lm_head.weight"]


async def test_ignore_state_changes_and_missing_methods_over_zmq(rig_factory) -> None:
    rig = rig_factory()
    engine = rig.engine(
        0, ignore_state_changes=True, missing_methods=frozenset({"reset_encoder_cache"})
    )
    await rig.front.handshake(0)
    assert await _value(rig, "sleep", (1, "abort")) is None
    assert await _value(rig, "pause_scheduler", ("keep",)) is None
    assert await _value(rig, "set_weight_version", ("v2",)) is None
    assert await _value(rig, "is_sleeping") is False
    assert await _value(rig, "is_scheduler_paused") is False
    assert await _value(rig, "get_weight_version") is None
    engine.state.sleeping_tags = {"weights"}
    assert await _value(rig, "wake_up", (None,)) is True  # claims fully awake...
    assert await _value(rig, "is_sleeping") is True  # ...but still sleeps
    assert (
        await _failure(rig, "reset_encoder_cache") == "Call to reset_encoder_cache method failed: "
        "'EngineCoreProc' object has no attribute 'reset_encoder_cache'"
    )
    assert await _value(rig, "reset_mm_cache") is None


def test_sim_engine_cli_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from exporter.commands import cli
    from exporter.sim import host

    seen: list[SimOptions] = []

    def fake_make_engines(address: str, indices: list[int], options: SimOptions, **_: Any):
        seen.append(options)
        return []

    async def fake_serve(engines: list[SimEngine], **_: Any) -> int:
        return 0

    monkeypatch.setattr(host, "make_engines", fake_make_engines)
    monkeypatch.setattr(host, "serve_engines", fake_serve)
    base = ["sim-engine", "--handshake-address", "tcp://127.0.0.1:1"]
    assert cli.main(base) == 0
    default = seen.pop()
    assert default.weight_version is None and default.corrupt_param is None
    assert not default.ignore_state_changes and default.missing_methods == frozenset()
    argv = [
        *base,
        "--weight-version",
        "step-3",
        "--corrupt-param",
        "lm_head.weight",
        "--ignore-state-changes",
        "--missing-method",
        "get_weight_version",
        "--missing-method",
        "reset_mm_cache",
    ]
    assert cli.main(argv) == 0
    options = seen.pop()
    assert options.weight_version == "step-3" and options.corrupt_param == "lm_head.weight"
    assert options.ignore_state_changes
    assert options.missing_methods == {"get_weight_version", "reset_mm_cache"}
