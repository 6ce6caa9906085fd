"""The simulated engine's state machine on its own: no sockets, no event loop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from exporter.sim.engine import SimOptions
from exporter.sim.state import (
    ALL_TAGS,
    PAUSE_MODES,
    Deferred,
    EngineState,
    UtilityFailure,
)
from exporter.sim.story import StoryState, story_state


def test_initial_state() -> None:
    fresh = EngineState.initial()
    assert (fresh.sleeping_tags, fresh.paused, fresh.refuse_reset) == (set(), False, False)
    assert not fresh.is_sleeping() and not fresh.is_scheduler_paused()
    asleep = EngineState.initial(sleeping=True)
    assert asleep.sleeping_tags == set(ALL_TAGS) and asleep.paused and asleep.is_sleeping()
    paused = EngineState.initial(paused=True)
    assert paused.sleeping_tags == set() and paused.is_sleeping() and paused.is_scheduler_paused()


def test_options_seed_a_fresh_state_each_time() -> None:
    options = SimOptions(sleeping=True, refuse_reset=True, drain_s=0.5, supports_pause_query=False)
    a, b = options.initial_state(), options.initial_state()
    assert a == EngineState(set(ALL_TAGS), True, True, 0.5, False)
    a.wake_up()
    assert b.is_sleeping(), "states built from the same options share nothing"
    assert options.sleeping, "the options are not changed"


def test_is_sleeping_is_tags_or_paused() -> None:
    state = EngineState()
    state.sleeping_tags = {"kv_cache"}
    assert state.is_sleeping() and not state.is_scheduler_paused()
    state.sleeping_tags = set()
    state.paused = True
    assert state.is_sleeping() and state.is_scheduler_paused()


def test_sleep_levels() -> None:
    state = EngineState()
    assert state.sleep(0) is None
    assert state.paused and state.sleeping_tags == set() and state.is_sleeping()
    for level in (1, 2):
        state = EngineState()
        assert state.sleep(level) is None
        assert state.paused and state.sleeping_tags == set(ALL_TAGS)


@pytest.mark.parametrize("mode", PAUSE_MODES)
def test_pause_modes_and_deferred_drain(mode: str) -> None:
    assert EngineState().pause_scheduler(mode) is None, "nothing to drain"
    draining = EngineState(drain_s=0.4)
    result = draining.pause_scheduler(mode)
    assert draining.paused
    assert result == (Deferred(0.4) if mode == "wait" else None)
    slept = EngineState(drain_s=0.4).sleep(1, mode)
    assert slept == (Deferred(0.4) if mode == "wait" else None)


def test_invalid_pause_mode_changes_nothing() -> None:
    state = EngineState()
    with pytest.raises(ValueError, match="Invalid pause mode: bogus"):
        state.sleep(1, "bogus")
    with pytest.raises(ValueError, match="Invalid pause mode: later"):
        state.pause_scheduler("later")
    assert state == EngineState()


def test_wake_up_semantics() -> None:
    state = EngineState.initial(sleeping=True)
    assert state.wake_up(["weights"]) is False  # partial wake: still asleep, still paused
    assert state.sleeping_tags == {"kv_cache"} and state.paused
    # Named tags that are not all asleep are ignored (a no-op).
    assert state.wake_up(["weights", "kv_cache"]) is False
    assert state.sleeping_tags == {"kv_cache"}
    assert state.wake_up(["kv_cache", "scheduling"]) is True  # "scheduling" is not a tag
    assert state.sleeping_tags == set() and not state.paused and not state.is_sleeping()

    state = EngineState.initial(sleeping=True)
    assert state.wake_up(None) is True and not state.is_sleeping()

    level0 = EngineState()
    level0.sleep(0)
    assert level0.wake_up(["scheduling"]) is True and not level0.paused
    level0.sleep(0)
    assert level0.wake_up() is True and not level0.paused


def test_resume_scheduler() -> None:
    state = EngineState()
    state.pause_scheduler("keep")
    state.resume_scheduler()
    assert not state.paused and not state.is_sleeping()


def test_reset_prefix_cache_refusal() -> None:
    state = EngineState()
    assert state.reset_prefix_cache() is True
    assert state.reset_prefix_cache(True, True) is True
    state.refuse_reset = True
    assert state.reset_prefix_cache() is False
    assert EngineState.initial(refuse_reset=True).reset_prefix_cache(False, False) is False


def test_method_table() -> None:
    table = {name: max_args for name, (_, max_args) in EngineState().methods().items()}
    assert table == {
        "is_sleeping": 0,
        "sleep": 2,
        "wake_up": 1,
        "reset_prefix_cache": 2,
        "pause_scheduler": 2,
        "resume_scheduler": 0,
        "is_scheduler_paused": 0,
    }
    old = EngineState(supports_pause_query=False).methods()
    assert "is_scheduler_paused" not in old and len(old) == 6


def test_call_values() -> None:
    state = EngineState(drain_s=0.25)
    assert state.call("is_sleeping") is False
    assert state.call("sleep", [1]) is None
    assert state.call("is_sleeping", []) is True
    assert state.call("is_scheduler_paused") is True
    assert state.call("wake_up", [["weights"]]) is False
    assert state.call("wake_up", [None]) is True
    assert state.call("pause_scheduler", ["wait", False]) == Deferred(0.25)
    assert state.call("resume_scheduler") is None
    for args in ((), (True,), (True, True)):
        assert state.call("reset_prefix_cache", args) is True


def test_call_failure_texts() -> None:
    state = EngineState(supports_pause_query=False)
    cases = [
        (
            "reset_mm_cache",
            (),
            "Call to reset_mm_cache method failed: "
            "'EngineCoreProc' object has no attribute 'reset_mm_cache'",
        ),
        (
            "is_scheduler_paused",
            (),
            "Call to is_scheduler_paused method failed: "
            "'EngineCoreProc' object has no attribute 'is_scheduler_paused'",
        ),
        ("reset_prefix_cache", (True, True, True), "Call to reset_prefix_cache method failed: "),
        ("is_sleeping", (1,), "Call to is_sleeping method failed: "),
        ("sleep", (1, "bogus"), "Call to sleep method failed: Invalid pause mode: bogus"),
    ]
    for method, args, text in cases:
        with pytest.raises(UtilityFailure) as info:
            state.call(method, args)
        assert str(info.value) == text
        assert info.value.method == method
    assert state == EngineState(supports_pause_query=False), "failed calls change nothing"


def test_apply_story() -> None:
    state = EngineState()
    state.apply_story(StoryState(paused=True, sleeping=False, refuse_reset=True))
    assert state.paused and state.sleeping_tags == set() and state.refuse_reset
    state.apply_story(StoryState(paused=False, sleeping=True, refuse_reset=False))
    assert state.paused and state.sleeping_tags == set(ALL_TAGS) and not state.refuse_reset
    state.apply_story(StoryState(paused=False, sleeping=False, refuse_reset=False))
    assert state == EngineState()


def test_story_over_a_period() -> None:
    """The lagging last engine disagrees with the others for a while (an inconsistency)."""
    period = 10.0
    fleet = [EngineState() for _ in range(3)]
    disagreed = refused = False
    for step in range(100):
        for offset, state in enumerate(fleet):
            state.apply_story(story_state(offset, len(fleet), step * period / 100, period))
        answers = {state.is_sleeping() for state in fleet}
        disagreed = disagreed or len(answers) > 1
        refused = refused or not fleet[1].reset_prefix_cache()
        assert fleet[0].reset_prefix_cache() and fleet[2].reset_prefix_cache()
    assert disagreed and refused


def test_state_module_is_pure() -> None:
    """Importing the state machine pulls in no sockets, no event loop, no HTTP."""
    code = (
        "import sys, exporter.sim.state; "
        "print(sorted(m for m in ('asyncio', 'zmq', 'aiohttp', 'socket') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.strip() == "[]"
