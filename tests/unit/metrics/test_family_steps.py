"""``family_steps`` and ``text_steps``, run whole (``run_steps``) or a step per loop turn
(``run_steps_async``: in-process mode, on vLLM's event loop). Run whole or
step by step they give the bytes prometheus_client's ``generate_latest`` gives for the same
state; their number of steps grows with the fleet (what keeps each step short); and the attach
mode's counters moving between steps do not change the build that started before."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, TypeVar

import msgspec
import pytest
from prometheus_client.exposition import generate_latest

from exporter.base import steps
from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import ENGINES_PER_STEP, Steps, run_steps, run_steps_async
from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import (
    ExporterCollector,
    build_registry,
    family_steps,
)
from exporter.metrics.stats import Stats
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FaultStatus, MembershipEvent
from tests.harness.snapshots import engine_snapshot, polled

T = TypeVar("T")
MODEL = 'm"x\\y\nz'  # every label value escaped
RELAY = "vllm_dp_relay_handshakes_total"
WRITES = "vllm_dp_state_file_writes_total"


def engine(i: int) -> EngineSnapshot:
    """Engine ``i`` of a varied fleet: awake and busy, asleep, down, paused, faulty, hung,
    registered."""
    name, kind = str(i), i % 7
    seen = 1000.0 + i if i % 2 else None
    down = EngineOutcome(name, Outcome.TIMEOUT, error="no reply within 1s")
    if kind == 0:
        busy = EngineDetail(name, True, "a", requests=RequestCounts(i % 5, i % 3))
        return engine_snapshot(
            name, busy, seen, is_sleeping=False, has_work=True, get_weight_version="step-7"
        )
    if kind == 1:
        return engine_snapshot(name, None, seen, is_sleeping=True, get_weight_version="step-7")
    if kind == 2:
        return engine_snapshot(name, None, seen, is_sleeping=down, get_weight_version=down)
    if kind == 3:
        return engine_snapshot(name, None, seen, is_sleeping=True, is_scheduler_paused=True)
    if kind == 4:
        faulty = EngineDetail(
            name,
            True,
            "a",
            fault_status=FaultStatus("dead" if i % 3 else "unhealthy", "gone", 7.0),
            membership=MembershipEvent("scale_down", i, name, 1234.5),
            pushes=(("fault_tolerance_status", i),),
        )
        return engine_snapshot(name, faulty, seen, is_sleeping=False, has_work=False)
    if kind == 5:
        awake = engine_snapshot(name, None, seen, is_sleeping=False, get_weight_version="v\\8")
        return dataclasses.replace(awake, hung=True, unresponsive_s=12.3456 + i)
    registered = EngineDetail(
        name,
        True,
        "a",
        vllm_version="0.33.0",
        enable_sleep_mode=True,
        registration=(("dtype", 'bf"16'), ("data_parallel_rank", i)),
    )
    return engine_snapshot(
        name, registered, seen, is_sleeping=False, get_weight_version="step-8", has_work=False
    )


def fleet(n: int) -> FleetSnapshot:
    return polled(*(engine(i) for i in range(n)), connected=n - 1, taken_at_unix=1.7e9)


def stats_for(snap: FleetSnapshot) -> tuple[Stats, ProtocolErrorTally]:
    stats = Stats()
    names = [e.engine for e in snap.engines]
    stats.preset(names)
    for method in ("is_sleeping", "get_weight_version", "has_work"):
        outcomes = [
            e.outcomes.get(method)
            or EngineOutcome(e.engine, Outcome.FAILED, error="x", duration_s=0.5)
            for e in snap.engines
        ]
        timed = [
            msgspec.structs.replace(o, duration_s=0.0007 * (k + 1)) if o.ok else o
            for k, o in enumerate(outcomes)
        ]
        stats.record_calls(method, timed)
    stats.record_poll(["get_weight_version"])
    stats.record_reset("partial_failure", [(n, "refused") for n in names[::9]], 0.3, 1.5e9)
    stats.record_confirmed_resets(names[1::9], "reset_prefix_cache", 1.6e9)
    stats.record_action("sleep", "success")
    stats.record_action("wake_up", "failure", [(names[2], "timeout")])
    stats.record_weight_verification({names[3]: 2})
    stats.record_admin_request("sleep", 200)
    faults = ProtocolErrorTally()
    faults.record("not_msgpack", "x")
    faults.http_listener("admin")("bad")
    return stats, faults


def counting(steps: Steps[T]) -> tuple[T, int]:
    """``steps`` driven one ``next`` at a time: its value and how many times it yielded."""
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            value: T = done.value
            return value, count
        count += 1


def legacy_text(
    snap: FleetSnapshot, stats: Stats, faults: ProtocolErrorTally, counters: dict[str, Any]
) -> bytes:
    """prometheus_client's own serialiser over the collector."""
    collector = ExporterCollector(
        lambda: snap, stats, faults, model_name=MODEL, client_counters=lambda: counters
    )
    return generate_latest(build_registry(collector))


@pytest.mark.parametrize("rows_per_step", [ENGINES_PER_STEP, 1, 5])
@pytest.mark.parametrize("lines_per_step", [steps.SAMPLES_PER_STEP, 1, 37])
def test_stepwise_builds_and_renders_are_byte_identical_to_generate_latest(
    monkeypatch: pytest.MonkeyPatch, rows_per_step: int, lines_per_step: int
) -> None:
    monkeypatch.setattr(steps, "ENGINES_PER_STEP", rows_per_step)
    monkeypatch.setattr(steps, "SAMPLES_PER_STEP", lines_per_step)
    snap = fleet(130)
    stats, faults = stats_for(snap)
    counters = {RELAY: {"relayed": 3, "refused": 1}}
    expected = legacy_text(snap, stats, faults, counters)
    built, family_count = counting(family_steps(snap, stats, faults, MODEL, counters))
    assert family_count > 1
    assert run_steps(text_steps(built)) == expected
    text, text_count = counting(text_steps(built))
    assert text == expected
    assert text_count >= 1  # more samples than one step writes
    whole = run_steps(family_steps(snap, stats, faults, model_name=MODEL, client_counters=counters))
    assert run_steps(text_steps(whole)) == expected
    # What the test covers is really there.
    for needle in (
        b'vllm_dp_engine_fault_tolerance_status{engine="4",model_name="m\\"x\\\\y\\nz"',
        b'vllm_dp_engine_state{engine="5",model_name="m\\"x\\\\y\\nz",state="hung"} 1.0',
        b'vllm_dp_engine_requests{engine="126",model_name="m\\"x\\\\y\\nz",state="running"} 1.0',
        b'vllm_dp_engine_membership_event_timestamp_seconds{engine="123",event="scale_down"',
        b'dtype="bf\\"16"',
        b'vllm_dp_relay_handshakes_total{model_name="m\\"x\\\\y\\nz",result="relayed"} 3.0',
        b"vllm_dp_utility_call_duration_seconds_bucket{",
        b'vllm_dp_engine_weight_version_info{engine="6",model_name="m\\"x\\\\y\\nz",'
        b'weight_version="step-8"} 1.0',
    ):
        assert needle in expected, needle


def test_text_steps_step_count_follows_the_samples() -> None:
    snap = fleet(300)
    stats, faults = stats_for(snap)
    built = run_steps(family_steps(snap, stats, faults))
    text, count = counting(text_steps(built))
    samples = sum(1 for line in text.splitlines() if not line.startswith(b"#"))
    assert samples > 3 * steps.SAMPLES_PER_STEP
    # About one step per SAMPLES_PER_STEP samples: never one long stretch.
    assert count >= samples // steps.SAMPLES_PER_STEP - 1
    assert count <= samples // steps.SAMPLES_PER_STEP + len(built)


def test_the_number_of_steps_grows_with_the_engines() -> None:
    counts = {}
    for n in (10, 100, 300):
        snap = fleet(n)
        stats, faults = stats_for(snap)
        built, counts[n] = counting(family_steps(snap, stats, faults))
        (up,) = [f.rows for f in built if f.spec.name == "vllm_dp_engine_up"]
        assert len(up) == n  # every engine built, whatever the number of steps
    assert counts[100] > 1
    assert counts[300] > counts[100] > counts[10]
    # At least one step per ENGINES_PER_STEP engines: a step covers a bounded number of them.
    assert counts[100] >= 100 // ENGINES_PER_STEP
    assert counts[300] >= 300 // ENGINES_PER_STEP


def test_the_collectors_steps_are_its_families() -> None:
    snap = fleet(100)
    stats, faults = stats_for(snap)
    counters = {RELAY: {"relayed": 1}}
    collector = ExporterCollector(
        lambda: snap, stats, faults, model_name=MODEL, client_counters=lambda: counters
    )
    built, count = counting(collector.family_steps())
    assert count > 1
    assert run_steps(text_steps(built)) == run_steps(text_steps(collector.families()))
    assert run_steps(text_steps(built)) == legacy_text(snap, stats, faults, counters)


async def test_counters_moving_between_steps_do_not_change_the_build() -> None:
    snap = fleet(200)
    stats, faults = stats_for(snap)
    counters: dict[str, dict[str, int]] = {RELAY: {"relayed": 3, "refused": 1}}
    expected = run_steps(
        text_steps(
            run_steps(family_steps(snap, stats, faults, model_name=MODEL, client_counters=counters))
        )
    )
    turns = 0

    async def mutate() -> None:
        """The attach mode counting (its dicts grow and change) while the build runs."""
        nonlocal turns
        while True:
            turns += 1
            counters[RELAY]["relayed"] += 1
            counters[RELAY][f"new-{turns}"] = turns
            counters.setdefault(WRITES, {})[f"outcome-{turns}"] = 1
            await asyncio.sleep(0)

    steps = family_steps(snap, stats, faults, MODEL, counters)
    task = asyncio.create_task(mutate())
    try:
        built = await run_steps_async(steps)
        during = turns
    finally:
        task.cancel()
    assert during >= 200 // ENGINES_PER_STEP  # the counters moved while the build ran
    assert run_steps(text_steps(built)) == expected
    assert counters[RELAY]["relayed"] > 3
    # A build started now sees the new values.
    later = run_steps(text_steps(run_steps(family_steps(snap, stats, faults, MODEL, counters))))
    assert later != expected
    assert f'result="new-{during}"'.encode() in later
