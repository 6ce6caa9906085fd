"""``InProcessFleetClient`` over a simulated vLLM ``AsyncLLM`` whose engine-core client talks
real ZMQ to simulated engines: one outcome per engine, a hung engine bounded in vLLM's table,
failures, refusals, the allow-list and an engine's death."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.sim_vllm import EngineDeadError
from exporter.client.fleet import READ_METHODS, STOPPING, EngineOutcome, Outcome, connected_count
from exporter.client.inprocess.client import MAX_IN_FLIGHT
from exporter.client.inprocess.fanout import ENGINE_CORE_DEAD
from exporter.error import MethodNotAllowed
from exporter.sim.options import SimOptions, SimReply
from tests.harness.inprocess import SimVllm, SimVllmFactory
from tests.harness.waiting import eventually

TIMEOUT = 0.3
#: A generous bound on a fan-out's wall time beyond its timeout (a shared 2-core machine).
SLACK_S = 2.0


def kinds(outcomes: list[EngineOutcome]) -> list[str]:
    return [o.outcome.value for o in outcomes]


async def test_every_engine_answers_in_rank_order(sim_vllm_factory: SimVllmFactory) -> None:
    sim = await sim_vllm_factory(
        4, sleeping={1: True, 3: True}, weight_version={0: "v7", 1: "v7", 2: "v8", 3: "v7"}
    )
    client = sim.fleet_client()
    assert client.engine_labels == ["0", "1", "2", "3"]
    assert connected_count(client) == 4
    details = client.engine_details()
    assert [d.engine for d in details] == ["0", "1", "2", "3"]
    assert all(d.connected and d.address == "in-process (vLLM client 0)" for d in details)

    sleeping = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [o.engine for o in sleeping] == ["0", "1", "2", "3"]
    assert kinds(sleeping) == ["ok"] * 4
    assert [o.value for o in sleeping] == [False, True, False, True]
    assert all(o.duration_s is not None and 0 <= o.duration_s < TIMEOUT for o in sleeping)

    versions = await client.call_utility("get_weight_version", timeout_s=TIMEOUT)
    assert [o.value for o in versions] == ["v7", "v7", "v8", "v7"]
    # Each engine got exactly its own call; vLLM's table holds nothing once all answered.
    assert sim.received("is_sleeping") == [1, 1, 1, 1]
    assert sim.received("get_weight_version") == [1, 1, 1, 1]
    assert sim.core.utility_results == {}
    assert client.in_flight == {}


async def test_a_subset_of_engines_is_asked_alone(sim_vllm: SimVllm) -> None:
    client = sim_vllm.fleet_client()
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=["2", "9"])
    assert [(o.engine, o.outcome) for o in got] == [("2", Outcome.OK)]
    assert sim_vllm.received("is_sleeping") == [0, 0, 1]


@pytest.mark.parametrize("hung", [0, 1, 2], ids=["first", "middle", "last"])
async def test_hung_engine_times_out_alone_and_stays_bounded(
    sim_vllm_factory: SimVllmFactory, hung: int
) -> None:
    sim = await sim_vllm_factory(3, hang={hung: True})
    client = sim.fleet_client()
    label = str(hung)

    started = time.monotonic()
    first = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    elapsed = time.monotonic() - started
    assert TIMEOUT * 0.9 <= elapsed < TIMEOUT + SLACK_S
    assert [o.engine for o in first] == ["0", "1", "2"]
    for o in first:
        if o.engine == label:
            assert o.outcome is Outcome.TIMEOUT
            assert o.error == f"no reply within {TIMEOUT:g}s"
        else:
            assert (o.outcome, o.value) == (Outcome.OK, False)
            # Its own round trip, not the fan-out's (which the hung engine stretched).
            assert o.duration_s is not None and o.duration_s < TIMEOUT * 0.9
    assert client.in_flight == {label: 1}

    # Fill the bound with concurrent polls (each waits the timeout once) ...
    rest = await asyncio.gather(
        *(client.call_utility("is_sleeping", timeout_s=TIMEOUT) for _ in range(MAX_IN_FLIGHT - 1))
    )
    assert all(kinds(r)[hung] == "timeout" for r in rest)
    assert client.in_flight == {label: MAX_IN_FLIGHT}

    # ... then many more: not sent to the hung engine, answered at once, the others unharmed.
    for _ in range(12):
        started = time.monotonic()
        got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
        assert time.monotonic() - started < TIMEOUT
        hung_outcome = got[hung]
        assert hung_outcome.outcome is Outcome.TIMEOUT
        assert hung_outcome.error == (
            f"not sent: {MAX_IN_FLIGHT} earlier calls to this engine are unanswered"
        )
        assert hung_outcome.duration_s == 0.0
        assert [o.outcome for i, o in enumerate(got) if i != hung] == [Outcome.OK] * 2

    # The hung engine read exactly the calls that were sent, and vLLM's table holds only those.
    await eventually(
        lambda: sim.engines[hung].calls == MAX_IN_FLIGHT, timeout_s=5, what="the hung reads"
    )
    assert len(sim.core.utility_results) == MAX_IN_FLIGHT
    assert client.in_flight == {label: MAX_IN_FLIGHT}
    assert [sim.engines[i].calls for i in range(3) if i != hung] == [MAX_IN_FLIGHT + 12] * 2


async def test_late_reply_resolves_a_timed_out_call(sim_vllm_factory: SimVllmFactory) -> None:
    """A timed-out call is left running: the engine's late reply pops vLLM's entry (vLLM's
    handler has no default) and the call stops counting against the bound."""
    sim = await sim_vllm_factory(2, reply_delay_s={1: 0.6})
    client = sim.fleet_client()
    got = await client.call_utility("is_sleeping", timeout_s=0.2)
    assert kinds(got) == ["ok", "timeout"]
    assert client.in_flight == {"1": 1}
    assert len(sim.core.utility_results) == 1
    await eventually(lambda: client.in_flight == {}, timeout_s=5, what="the late reply")
    assert sim.core.utility_results == {}
    sim.engines[1].options.reply_delay_s = 0.0
    again = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert kinds(again) == ["ok", "ok"]
    assert not sim.core.resources.engine_dead


async def test_failure_message_is_failed_with_its_text(sim_vllm: SimVllm) -> None:
    sim_vllm.script(1, lambda _c, _i, method, _a: SimReply(failure="CUDA error: out of memory"))
    client = sim_vllm.fleet_client()
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert kinds(got) == ["ok", "failed", "ok"]
    assert got[1].error == "CUDA error: out of memory"
    assert got[1].shutting_down is False
    assert got[1].duration_s is not None

    sim_vllm.script(2, lambda _c, _i, method, _a: SimReply(failure="Server shutting down"))
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert kinds(got) == ["ok", "failed", "failed"]
    assert got[2].shutting_down is True
    # A failure is an answer: nothing is marked dead, nothing waits.
    assert not sim_vllm.core.resources.engine_dead
    assert client.in_flight == {}


async def test_refused_reset_is_ok_with_false(sim_vllm_factory: SimVllmFactory) -> None:
    sim = await sim_vllm_factory(3, refuse_reset={2: True})
    client = sim.fleet_client()
    got = await client.call_utility("reset_prefix_cache", timeout_s=TIMEOUT)
    assert kinds(got) == ["ok", "ok", "ok"]
    assert [o.value for o in got] == [True, True, False]
    assert sim.received("reset_prefix_cache") == [1, 1, 1]


async def test_unsupported_method_fails_with_vllms_text(sim_vllm_factory: SimVllmFactory) -> None:
    sim = await sim_vllm_factory(3, missing_methods={0: frozenset({"is_scheduler_paused"})})
    client = sim.fleet_client()
    got = await client.call_utility("is_scheduler_paused", timeout_s=TIMEOUT)
    assert kinds(got) == ["failed", "ok", "ok"]
    assert got[0].error is not None
    assert got[0].error.endswith("'EngineCoreProc' object has no attribute 'is_scheduler_paused'")
    assert [o.value for o in got[1:]] == [False, False]


async def test_method_off_the_allow_list_is_refused_before_sending(sim_vllm: SimVllm) -> None:
    client = sim_vllm.fleet_client()
    readonly = sim_vllm.fleet_client(allowed_methods=READ_METHODS)
    with pytest.raises(MethodNotAllowed, match="collective_rpc"):
        await client.call_utility("collective_rpc", ("reload_weights",), timeout_s=TIMEOUT)
    with pytest.raises(MethodNotAllowed, match="shutdown"):
        await client.call_utility("shutdown", timeout_s=TIMEOUT)
    with pytest.raises(MethodNotAllowed, match="reset_prefix_cache"):
        await readonly.call_utility("reset_prefix_cache", timeout_s=TIMEOUT)
    assert "collective_rpc" not in client.capabilities.methods
    assert "reset_prefix_cache" not in readonly.capabilities.methods
    assert "is_sleeping" in readonly.capabilities.methods
    assert sim_vllm.core.utility_results == {}
    assert client.in_flight == {} and readonly.in_flight == {}
    # An allowed call afterwards is the first request any engine reads (ZMQ keeps order).
    got = await readonly.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert kinds(got) == ["ok"] * 3
    assert [e.received for e in sim_vllm.engines] == [[("is_sleeping", [])]] * 3
    assert sim_vllm.calls() == [1, 1, 1]


async def test_engine_death_disconnects_every_engine(sim_vllm: SimVllm) -> None:
    client = sim_vllm.fleet_client()
    assert kinds(await client.call_utility("is_sleeping", timeout_s=TIMEOUT)) == ["ok"] * 3
    dying = sim_vllm.engines[1]
    dying.options.dead_after_calls = dying.calls + 1  # answers its next call, then dies
    assert kinds(await client.call_utility("is_sleeping", timeout_s=TIMEOUT)) == ["ok"] * 3
    assert await asyncio.wait_for(sim_vllm.tasks[1], 5) == "dead"

    seen: list[list[str]] = []

    async def all_disconnected() -> bool:
        got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
        seen.append(kinds(got))
        return all(o.outcome is Outcome.DISCONNECTED and o.error == ENGINE_CORE_DEAD for o in got)

    deadline = time.monotonic() + 5
    while not await all_disconnected():
        assert time.monotonic() < deadline, seen
        await asyncio.sleep(0.02)
    # vLLM's client saw the death (first on the dead engine's own call) and the whole front end
    # is dead from then on: every engine disconnected, every call answered, nothing raised.
    assert sim_vllm.core.resources.engine_dead
    assert seen[0][1] == "disconnected"
    assert connected_count(client) == 0
    assert [d.connected for d in client.engine_details()] == [False] * 3
    for method in ("reset_prefix_cache", "get_weight_version"):
        got = await client.call_utility(method, timeout_s=TIMEOUT)
        assert kinds(got) == ["disconnected"] * 3
    with pytest.raises(EngineDeadError):
        await sim_vllm.direct_call("is_sleeping", 0)
    assert client.in_flight == {}


async def test_stopped_engine_disconnects_every_engine(sim_vllm: SimVllm) -> None:
    client = sim_vllm.fleet_client()
    assert kinds(await client.call_utility("is_sleeping", timeout_s=TIMEOUT)) == ["ok"] * 3
    await sim_vllm.stop_engine(2)
    deadline = time.monotonic() + 5
    while True:
        got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
        if kinds(got) == ["disconnected"] * 3:
            break
        assert kinds(got)[:2] == ["ok", "ok"] or sim_vllm.core.resources.engine_dead
        assert time.monotonic() < deadline, kinds(got)
        await asyncio.sleep(0.02)
    assert sim_vllm.core.resources.engine_dead
    assert all(o.error == ENGINE_CORE_DEAD for o in got)


async def test_close_cancels_a_fan_out_in_progress(sim_vllm_factory: SimVllmFactory) -> None:
    sim = await sim_vllm_factory(3, hang={1: True})
    client = sim.fleet_client()
    pending = asyncio.ensure_future(client.call_utility("is_sleeping", timeout_s=5.0))
    await eventually(lambda: sim.engines[1].calls == 1, timeout_s=5, what="the hung read")
    started = time.monotonic()
    await client.close()
    got = await asyncio.wait_for(pending, 2)
    assert time.monotonic() - started < 1.0  # not the 5 s timeout
    assert kinds(got) == ["ok", "disconnected", "ok"]
    assert got[1].error == STOPPING
    await eventually(lambda: client.in_flight == {}, timeout_s=2, what="the cancellation")
    after = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert kinds(after) == ["disconnected"] * 3
    assert all(o.error == STOPPING for o in after)
    assert sim.calls()[1] == 1  # nothing sent after close


async def test_close_cancels_calls_of_a_cancelled_caller(sim_vllm_factory: SimVllmFactory) -> None:
    """The poller's task is cancelled at stop while its fan-out waits: close() still reaches the
    calls that fan-out left behind."""
    sim = await sim_vllm_factory(2, hang={0: True})
    client = sim.fleet_client()
    caller = asyncio.ensure_future(client.call_utility("is_sleeping", timeout_s=5.0))
    await eventually(lambda: sim.engines[0].calls == 1, timeout_s=5, what="the hung read")
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(caller, 2)
    assert client.in_flight == {"0": 1}
    await client.close()
    await eventually(lambda: client.in_flight == {}, timeout_s=2, what="the cancellation")


async def test_sleeping_engines_report_through_vllms_client(
    sim_vllm_factory: SimVllmFactory,
) -> None:
    sim = await sim_vllm_factory(
        3, by_index={0: SimOptions(sleeping=True), 2: SimOptions(paused=True)}
    )
    client = sim.fleet_client()
    sleeping, paused = await asyncio.gather(
        client.call_utility("is_sleeping", timeout_s=TIMEOUT),
        client.call_utility("is_scheduler_paused", timeout_s=TIMEOUT),
    )
    # vLLM: asleep at level 1 pauses the scheduler; a paused scheduler counts as sleeping.
    assert [o.value for o in sleeping] == [True, False, True]
    assert [o.value for o in paused] == [True, False, True]
    assert client.in_flight == {} and sim.core.utility_results == {}
