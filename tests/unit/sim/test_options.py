"""What a simulated engine and a simulated API server are told: ``SimOptions`` seeds a state
machine once (the wire-side faults stay live on the options), ``SimReply`` is a test's answer,
``ApiServerOptions`` one server's. (How the seeded state then behaves: ``test_state.py``.)"""

from __future__ import annotations

import dataclasses

import pytest

from exporter.protocol.utility import ABSENT
from exporter.sim.options import ApiServerOptions, SimOptions, SimReply
from exporter.sim.state import ALL_TAGS, EngineState


def test_a_reply_is_a_value_or_a_failure_and_cannot_change() -> None:
    assert (SimReply().value, SimReply().failure) == (None, None)
    assert SimReply(value=[1, 2]).value == [1, 2]
    failed = SimReply(failure="Call to sleep method failed: no")
    assert failed.failure == "Call to sleep method failed: no" and failed.value is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        failed.value = 1  # type: ignore[misc]


def test_the_defaults_are_a_healthy_vllm_033_engine() -> None:
    options = SimOptions()
    assert (options.vllm_version, options.enable_sleep_mode) == ("0.33.0", True)
    assert not (options.hang or options.frozen or options.sleeping or options.paused)
    assert options.dead_after_calls is None and options.exit_after_calls is None
    assert options.engine_notifications is ABSENT, "9 positions, as vLLM 0.33 sends"
    assert options.kv_events is None and options.registration_extra is None


def test_sleep_without_pause_is_seeded() -> None:
    """``sleep_pauses=False``: sleeping leaves the scheduler running (vLLM's draft change)."""
    state = SimOptions(sleep_pauses=False).initial_state()
    state.sleep(1)
    assert state.is_sleeping() and not state.is_scheduler_paused()
    paused = SimOptions().initial_state()
    paused.sleep(1)
    assert paused.is_scheduler_paused()


def test_the_seed_covers_every_state_field() -> None:
    options = SimOptions(
        sleeping=True,
        refuse_reset=True,
        drain_s=2.0,
        supports_pause_query=False,
        weight_version="w3",
        tp_size=4,
        empty_params=frozenset({"lm_head.weight"}),
        missing_methods=frozenset({"has_work"}),
    )
    state = options.initial_state(dp_rank=7)
    assert state.sleeping_tags == set(ALL_TAGS) and state.paused and state.refuse_reset
    assert (state.drain_s, state.weight_version, state.dp_rank, state.tp_size) == (
        2.0,
        "w3",
        7,
        4,
    )
    assert state.empty_params == frozenset({"lm_head.weight"})
    assert "is_scheduler_paused" not in state.methods() and "has_work" not in state.methods()


def test_wire_side_faults_are_not_part_of_the_state() -> None:
    """``hang``, delays and exits are read live by the engine: the state is the same."""
    faulty = SimOptions(hang=True, reply_delay_s=3.0, dead_after_calls=1, frozen=True)
    assert faulty.initial_state() == EngineState()


def test_an_api_servers_options_share_nothing_between_instances() -> None:
    a, b = ApiServerOptions(), ApiServerOptions()
    a.engine_options.append(SimOptions(sleeping=True))
    a.failures[0] = "boom"
    assert (b.engine_options, b.failures) == ([], {})
    assert (b.engines, b.dev_mode, b.close_after_500, b.log_stats) == (2, True, True, True)
    assert b.rust_front_end is None and b.fault_tolerance_prefix == ""
    assert b.missing_routes == frozenset()
