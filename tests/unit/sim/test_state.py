"""The simulated engine's state machine on its own: no sockets, no event loop."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

from exporter.protocol.utility import PAUSE_MODES
from exporter.sim.options import SimOptions
from exporter.sim.state import (
    ALL_TAGS,
    PARAMETER_NAMES,
    STATE_CHANGING,
    Deferred,
    EngineState,
    UtilityFailure,
    rank_prefix,
)
from exporter.sim.story import StoryState, run_story, story_state


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
        "has_work": 0,
        "is_sleeping": 0,
        "sleep": 2,
        "wake_up": 1,
        "reset_prefix_cache": 2,
        "pause_scheduler": 2,
        "resume_scheduler": 0,
        "is_scheduler_paused": 0,
        "reset_mm_cache": 0,
        "reset_encoder_cache": 0,
        "get_weight_version": 0,
        "set_weight_version": 1,
        "compute_weight_checksums": 0,
        "is_inference_ready": 0,
    }
    old = EngineState(supports_pause_query=False).methods()
    assert "is_scheduler_paused" not in old and len(old) == 13
    lacking = EngineState(missing_methods=frozenset({"get_weight_version", "nonexistent"}))
    assert "get_weight_version" not in lacking.methods() and len(lacking.methods()) == 13


def test_inference_ready_is_awake_and_not_paused() -> None:
    state = EngineState()
    assert state.call("is_inference_ready") is True
    state.paused = True
    assert state.call("is_inference_ready") is False
    state.paused, state.sleeping_tags = False, {"weights"}
    assert state.call("is_inference_ready") is False


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
            "release_kv_cache_memory",
            (),
            "Call to release_kv_cache_memory method failed: "
            "'EngineCoreProc' object has no attribute 'release_kv_cache_memory'",
        ),
        (
            "set_weight_version",
            (),
            "Call to set_weight_version method failed: "
            "EngineCore.set_weight_version() missing 1 required positional argument: 'version'",
        ),
        ("set_weight_version", ("a", "b"), "Call to set_weight_version method failed: "),
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


def test_weight_version_and_cache_resets() -> None:
    state = EngineState()
    assert state.get_weight_version() is None and state.call("get_weight_version") is None
    assert state.call("set_weight_version", ["step-1"]) is None
    assert state.get_weight_version() == "step-1" and state.weight_version == "step-1"
    state.set_weight_version("step-2")
    assert state.call("get_weight_version", []) == "step-2"
    assert EngineState.initial(weight_version="v0").get_weight_version() == "v0"
    before = EngineState.initial(sleeping=True, weight_version="v")
    snapshot = (set(before.sleeping_tags), before.paused, before.weight_version)
    assert before.call("reset_mm_cache") is None and before.call("reset_encoder_cache") is None
    assert (before.sleeping_tags, before.paused, before.weight_version) == snapshot


def test_checksums_shape_and_rank_prefixes() -> None:
    workers = EngineState(dp_rank=3).compute_weight_checksums()
    assert len(workers) == 1
    [worker] = workers
    assert list(worker) == [f"dp3:pp0:pcp0:tp0:ep0:{name}" for name in PARAMETER_NAMES]
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in worker.values())  # sha256 hex
    assert rank_prefix(1, pp=2, pcp=3, tp=4, ep=5) == "dp1:pp2:pcp3:tp4:ep5:"
    tp2 = EngineState(dp_rank=0, tp_size=2).compute_weight_checksums()
    assert [next(iter(w)).split("model.")[0] for w in tp2] == [
        "dp0:pp0:pcp0:tp0:ep0:",
        "dp0:pp0:pcp0:tp1:ep0:",
    ]
    # Different TP shards of the same parameter hold different bytes.
    name = PARAMETER_NAMES[0]
    assert tp2[0][f"dp0:pp0:pcp0:tp0:ep0:{name}"] != tp2[1][f"dp0:pp0:pcp0:tp1:ep0:{name}"]
    assert (
        EngineState().call("compute_weight_checksums") == EngineState().compute_weight_checksums()
    )


def _by_position(workers: list[dict[str, str]]) -> dict[str, str]:
    """Checksums keyed without their dp part (what must agree across DP ranks)."""
    return {k.split(":", 1)[1]: v for w in workers for k, v in w.items()}


def test_checksums_agree_across_dp_ranks_when_versions_agree() -> None:
    a = EngineState(dp_rank=0, tp_size=2, weight_version="v1")
    b = EngineState(dp_rank=1, tp_size=2, weight_version="v1")
    assert _by_position(a.compute_weight_checksums()) == _by_position(b.compute_weight_checksums())
    b.set_weight_version("v2")
    differ = (
        _by_position(a.compute_weight_checksums()).items()
        ^ _by_position(b.compute_weight_checksums()).items()
    )
    assert len(differ) == 2 * 2 * len(PARAMETER_NAMES), "every digest changes with the version"
    assert (
        EngineState(dp_rank=5).compute_weight_checksums()
        != EngineState(dp_rank=5, weight_version="x").compute_weight_checksums()
    )


def test_corrupt_param_differs_on_that_engine_only() -> None:
    name = PARAMETER_NAMES[2]
    good = _by_position(EngineState(dp_rank=0, tp_size=2).compute_weight_checksums())
    bad = _by_position(
        EngineState(dp_rank=1, tp_size=2, corrupt_param=name).compute_weight_checksums()
    )
    assert good.keys() == bad.keys()
    assert sorted(k for k in good if good[k] != bad[k]) == [
        f"pp0:pcp0:tp0:ep0:{name}",
        f"pp0:pcp0:tp1:ep0:{name}",
    ]


def test_ignore_state_changes_answers_success_and_changes_nothing() -> None:
    assert {
        "sleep",
        "wake_up",
        "pause_scheduler",
        "resume_scheduler",
        "set_weight_version",
    } == STATE_CHANGING
    state = EngineState(drain_s=1.0, ignore_state_changes=True, weight_version="v1")
    assert state.call("sleep", [1, "wait"]) is None  # not even deferred: nothing happens
    assert state.call("pause_scheduler", ["keep"]) is None
    assert state.call("set_weight_version", ["v2"]) is None
    assert not state.is_sleeping() and state.get_weight_version() == "v1"
    asleep = EngineState.initial(sleeping=True, ignore_state_changes=True)
    assert asleep.call("wake_up", [None]) is True, "claims to be fully awake"
    assert asleep.call("resume_scheduler") is None
    assert asleep.is_sleeping() and asleep.is_scheduler_paused()
    # Arguments are still checked, and read methods still answer the truth.
    with pytest.raises(UtilityFailure, match="Invalid pause mode: bogus"):
        state.call("sleep", [1, "bogus"])
    with pytest.raises(UtilityFailure, match="Invalid pause mode: later"):
        state.call("pause_scheduler", ["later"])
    with pytest.raises(UtilityFailure, match="missing 1 required positional argument"):
        state.call("set_weight_version", [])
    assert state.call("reset_prefix_cache") is True


def test_missing_methods_answer_no_attribute() -> None:
    state = EngineState.initial(missing_methods=frozenset({"get_weight_version", "sleep"}))
    for method in ("get_weight_version", "sleep"):
        with pytest.raises(UtilityFailure) as info:
            state.call(method, [])
        assert str(info.value) == (
            f"Call to {method} method failed: 'EngineCoreProc' object has no attribute '{method}'"
        )
    assert state.call("is_sleeping") is False


def test_options_seed_the_rl_state() -> None:
    options = SimOptions(
        weight_version="v9",
        tp_size=2,
        corrupt_param="lm_head.weight",
        ignore_state_changes=True,
        missing_methods=frozenset({"reset_mm_cache"}),
    )
    state = options.initial_state(4)
    assert (state.weight_version, state.dp_rank, state.tp_size) == ("v9", 4, 2)
    assert state.corrupt_param == "lm_head.weight" and state.ignore_state_changes
    assert "reset_mm_cache" not in state.methods()
    assert SimOptions().initial_state() == EngineState(), "defaults unchanged"


def test_apply_story() -> None:
    state = EngineState()
    state.apply_story(StoryState(paused=True, sleeping=False, refuse_reset=True), 1.0)
    assert state.paused and state.sleeping_tags == set() and state.refuse_reset
    state.apply_story(StoryState(paused=False, sleeping=True, refuse_reset=False), 2.0)
    assert state.paused and state.sleeping_tags == set(ALL_TAGS) and not state.refuse_reset
    state.apply_story(StoryState(paused=False, sleeping=False, refuse_reset=False), 3.0)
    assert not state.paused and not state.sleeping_tags and not state.refuse_reset
    assert not state.has_work(), "no traffic in the story: no request arrived"


def test_story_over_a_period() -> None:
    """The lagging last engine disagrees with the others for a while (an inconsistency)."""
    period = 10.0
    fleet = [EngineState() for _ in range(3)]
    disagreed = refused = False
    for step in range(100):
        t = step * period / 100
        for offset, state in enumerate(fleet):
            state.apply_story(story_state(offset, len(fleet), t, period), t)
        answers = {state.is_sleeping() for state in fleet}
        disagreed = disagreed or len(answers) > 1
        refused = refused or not fleet[1].reset_prefix_cache()
        assert fleet[0].reset_prefix_cache() and fleet[2].reset_prefix_cache()
    assert disagreed and refused


def test_the_story_drains_before_its_pause_and_queues_one_request_behind_it() -> None:
    """Traffic stops before the pause: every engine drains; while paused, the last engine
    holds one waiting request (work on an unroutable rank), which runs after the resume."""
    period = 40.0
    fleet = [EngineState() for _ in range(3)]
    seen: dict[str, list[tuple[int, int]]] = {"busy": [], "before_pause": [], "paused": []}
    for step in range(int(period / 0.2) + 1):
        t = step * 0.2
        phase = t / period
        for offset, state in enumerate(fleet):
            state.apply_story(story_state(offset, len(fleet), t, period), t)
        counts = [state.request_counts(t) for state in fleet]
        if phase < 0.04:
            seen["busy"].extend(counts)
        elif 0.09 <= phase < 0.10:
            seen["before_pause"].extend(counts)
        elif 0.16 <= phase < 0.20:
            seen["paused"].append(counts[-1])
            assert counts[0] == counts[1] == (0, 0)
    assert any(running for running, _ in seen["busy"]), "traffic gives the engines work"
    assert set(seen["before_pause"]) == {(0, 0)}, "drained before the pause"
    assert seen["paused"] and set(seen["paused"]) == {(0, 1)}, "one request waits behind it"


def test_the_story_hangs_the_second_engine_at_the_end_of_each_period() -> None:
    period = 40.0
    hung = {t: [story_state(i, 3, t, period).hung for i in range(3)] for t in (30.0, 36.0, 39.9)}
    assert hung == {30.0: [False] * 3, 36.0: [False, True, False], 39.9: [False, True, False]}
    assert story_state(0, 1, 36.0, period).hung, "a fleet of one hangs its only engine"
    assert not story_state(1, 3, 41.0, period).hung, "it recovers with the next period"


def test_the_story_reports_a_fault_window_on_the_first_engine() -> None:
    period = 100.0
    assert story_state(0, 3, 80.0, period).fault == "unhealthy"
    assert {story_state(0, 3, t, period).fault for t in (0.0, 50.0, 74.9, 85.0)} == {"healthy"}
    assert {story_state(i, 3, 80.0, period).fault for i in (1, 2)} == {"healthy"}


async def test_run_story_reports_the_fault_at_start_and_on_change() -> None:

    reported: list[str] = []
    both = asyncio.Event()

    async def report(status: str) -> None:
        reported.append(status)
        if {"healthy", "unhealthy"} <= set(reported):
            both.set()

    # A 0.5 s period: the fault window is 0.375-0.425 s of every period (checked every 10 ms).
    task = asyncio.create_task(run_story(lambda _s, _t: None, 0, 1, 0.5, report))
    await asyncio.wait_for(both.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert reported[0] in ("healthy", "unhealthy")
    assert "unhealthy" in reported and "healthy" in reported
    assert all(a != b for a, b in itertools.pairwise(reported))  # changes only
