"""The simulated engine's checkpoint lifecycle, as vLLM 0.34's ``EngineCore`` rules it."""

from __future__ import annotations

import pytest

from exporter.sim.checkpoint import SimCheckpoint, has_lifecycle
from exporter.sim.options import SimOptions
from exporter.sim.state import UtilityFailure


def test_only_engines_from_0_34_have_it() -> None:
    assert has_lifecycle("0.34.0") and has_lifecycle("0.35.0rc1") and has_lifecycle("1.0")
    assert not has_lifecycle("0.33.0") and not has_lifecycle("0.30.1+cpu")
    old = SimOptions().initial_state()
    assert old.checkpoint is None and "checkpoint_state" not in old.methods()


def test_a_cycle_prepare_drain_prepared_restore_running() -> None:
    state = SimOptions(vllm_version="0.34.0", drain_s=2.0).initial_state()
    assert state.call("checkpoint_state", now=0.0) == ["running", None]
    assert state.call("checkpoint_prepare", ["wait"], now=1.0) is None
    assert state.call("checkpoint_state", now=2.0) == ["preparing", None]
    assert state.is_scheduler_paused()
    assert state.call("checkpoint_prepare", ["wait"], now=2.5) is None  # a repeat: no-op
    assert state.call("checkpoint_state", now=3.0) == ["prepared", None]
    with pytest.raises(UtilityFailure, match="Cannot sleep while the checkpoint state"):
        state.call("sleep", [1], now=3.0)
    assert state.call("checkpoint_restore", now=4.0) is None
    assert state.call("checkpoint_state", now=4.0) == ["running", None]
    assert not state.is_scheduler_paused()


def test_refusals_change_nothing() -> None:
    asleep = SimOptions(vllm_version="0.34.0", sleeping=True).initial_state()
    assert "awake engine" in asleep.call("checkpoint_prepare", now=0.0)
    no_sleep = SimOptions(vllm_version="0.34.0", enable_sleep_mode=False).initial_state()
    assert "--enable-sleep-mode" in no_sleep.call("checkpoint_prepare", now=0.0)
    assert no_sleep.call("checkpoint_state", now=0.0) == ["running", None]
    with pytest.raises(UtilityFailure, match="Cannot restore while the checkpoint state"):
        failing = SimOptions(vllm_version="0.34.0", checkpoint_fault="boom").initial_state()
        failing.call("checkpoint_prepare", ["abort"], now=0.0)
        assert failing.call("checkpoint_state", now=0.1) == ["failed", "boom"]
        failing.call("checkpoint_restore", now=0.2)


def test_the_fault_ends_a_prepare_failed() -> None:
    cp = SimCheckpoint(fail_with="boom")
    cp.start_prepare(0.0, 1.0)
    cp.tick(0.5)
    assert cp.answer() == ["preparing", None]
    cp.tick(1.0)
    assert cp.answer() == ["failed", "boom"]
