"""``exporter/sim/work.py``: a simulated engine's requests (admitted up to ``max_running``, run
for their duration, queued behind a paused scheduler; pause modes abort / keep / wait), and how
``EngineState`` drives them (``submit``, ``request_counts``, ``has_work``, a pause with mode
``wait`` answering once the running requests finished). Time is the caller's: pure."""

from __future__ import annotations

import pytest

from exporter.sim.state import Deferred, EngineState
from exporter.sim.work import MAX_RUNNING, Work


def test_a_request_waits_for_a_free_slot_then_runs_for_its_duration() -> None:
    work = Work(max_running=2)
    assert not work.has_work() and work.counts() == (0, 0)
    work.submit(1.0, now=10.0, count=3)
    assert work.counts() == (2, 1) and work.has_work()
    work.advance(10.5)
    assert work.counts() == (2, 1)
    work.advance(11.0)  # the first two are done: the third takes a slot, its second starts now
    assert work.counts() == (1, 0)
    work.advance(11.9)
    assert work.counts() == (1, 0)
    work.advance(12.0)
    assert work.counts() == (0, 0) and not work.has_work()


def test_the_default_slots_are_vllms_max_num_seqs_in_miniature() -> None:
    work = Work()
    work.submit(5.0, now=0.0, count=MAX_RUNNING + 2)
    assert work.counts() == (MAX_RUNNING, 2)


def test_time_that_runs_backwards_runs_nothing() -> None:
    work = Work()
    work.submit(2.0, now=100.0)
    work.advance(50.0)
    assert work.running == [2.0]
    work.advance(51.0)  # measured from the last call's time, whatever it was
    assert work.running == [1.0]


def test_a_request_of_no_duration_is_done_at_once() -> None:
    work = Work()
    work.submit(0.0, now=1.0)
    assert not work.has_work()
    work.submit(-3.0, now=1.0)  # a negative duration is none
    assert not work.has_work()


def test_requests_of_different_lengths_finish_one_by_one() -> None:
    work = Work()
    work.submit(1.0, now=0.0)
    work.submit(3.0, now=0.0)
    work.advance(2.0)
    assert work.running == [1.0]
    work.advance(3.0)
    assert not work.has_work()


# -- pause modes ------------------------------------------------------------------------------


def test_abort_drops_every_request_and_answers_at_once() -> None:
    work = Work(max_running=1)
    work.submit(5.0, now=0.0, count=3)
    assert work.pause("abort", now=1.0) == 0.0
    assert work.paused and not work.has_work() and work.counts() == (0, 0)


def test_keep_freezes_the_requests_where_they_are() -> None:
    work = Work(max_running=1)
    work.submit(2.0, now=0.0, count=2)
    assert work.pause("keep", now=1.0) == 0.0
    work.advance(100.0)
    assert work.running == [1.0] and work.counts() == (1, 1) and work.has_work()
    work.submit(1.0, now=101.0)  # a new request queues behind the paused scheduler
    assert work.counts() == (1, 2)
    work.resume(now=200.0)  # the time paused does not count
    assert work.running == [1.0]
    work.advance(201.0)  # the running one is done, the next takes its slot
    assert work.counts() == (1, 1)


def test_wait_lets_the_running_requests_finish_while_new_ones_queue() -> None:
    work = Work(max_running=2)
    work.submit(3.0, now=0.0)
    work.submit(1.5, now=0.0)
    work.submit(9.0, now=0.0)  # no slot: waits
    # The pause answers when the longest running request is done.
    assert work.pause("wait", now=1.0) == pytest.approx(2.0)
    assert work.counts() == (2, 1)
    work.submit(1.0, now=1.5)  # queued while paused; the shorter running one is done
    assert work.counts() == (1, 2)
    work.advance(3.0)
    assert work.running == [] and work.counts() == (0, 2)
    assert work.has_work(), "a paused scheduler with queued requests is not a quiet one"
    work.advance(50.0)
    assert work.counts() == (0, 2)  # nothing is admitted while paused
    work.resume(now=60.0)
    assert work.counts() == (2, 0)
    assert work.running == [9.0, 1.0]


def test_wait_with_nothing_running_answers_at_once() -> None:
    work = Work()
    assert work.pause("wait", now=0.0) == 0.0
    assert work.paused and work.drain and not work.has_work()


def test_resume_ends_the_drain_and_admits_the_queue() -> None:
    work = Work(max_running=1)
    work.pause("wait", now=0.0)
    work.submit(1.0, now=0.0)
    assert work.counts() == (0, 1)
    work.resume(now=5.0)
    assert not work.paused and not work.drain and work.counts() == (1, 0)
    work.advance(6.0)
    assert not work.has_work()


# -- driven by EngineState --------------------------------------------------------------------


def test_the_engine_state_runs_its_requests_on_the_drivers_clock() -> None:
    state = EngineState()
    assert state.call("has_work", now=0.0) is False
    state.submit(2.0, now=0.0, count=2)
    assert state.call("has_work", now=1.0) is True
    assert state.request_counts(1.0) == (2, 0)
    assert state.call("has_work", now=2.0) is False
    assert state.request_counts(2.5) == (0, 0)


def test_a_call_without_a_time_leaves_the_requests_as_they_stood() -> None:
    state = EngineState()
    state.submit(1.0, now=0.0)
    assert state.call("has_work") is True
    assert state.call("has_work") is True
    assert state.call("has_work", now=1.0) is False


def test_pause_wait_answers_once_the_longest_running_request_is_done() -> None:
    state = EngineState()
    state.submit(3.0, now=10.0)
    state.submit(1.0, now=10.0)
    answer = state.call("pause_scheduler", ["wait"], now=11.0)
    assert isinstance(answer, Deferred) and answer.delay_s == pytest.approx(2.0)
    assert state.paused and state.call("is_scheduler_paused", now=11.0) is True
    assert state.request_counts(11.0) == (1, 0)  # the short one was done already
    state.submit(5.0, now=11.5)  # arrives while paused: queued
    assert state.request_counts(11.5) == (1, 1)
    assert state.call("has_work", now=13.0) is True  # the queued one
    assert state.request_counts(13.0) == (0, 1)
    state.call("resume_scheduler", now=20.0)
    assert state.request_counts(20.0) == (1, 0)
    assert state.call("has_work", now=25.0) is False


def test_pause_wait_takes_the_longer_of_the_engines_drain_and_its_requests() -> None:
    slow = EngineState(drain_s=5.0)
    slow.submit(1.0, now=0.0)
    assert slow.call("pause_scheduler", ["wait"], now=0.0) == Deferred(5.0)
    quick = EngineState(drain_s=0.5)
    quick.submit(4.0, now=0.0)
    assert quick.call("pause_scheduler", ["wait"], now=0.0) == Deferred(4.0)
    idle = EngineState()
    assert idle.call("pause_scheduler", ["wait"], now=0.0) is None


@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_the_other_pause_modes_answer_at_once(mode: str) -> None:
    state = EngineState(drain_s=5.0)
    state.submit(4.0, now=0.0, count=2)
    assert state.call("pause_scheduler", [mode], now=1.0) is None
    assert state.request_counts(9.0) == ((0, 0) if mode == "abort" else (2, 0))


def test_sleep_pauses_the_requests_and_wake_up_resumes_them() -> None:
    state = EngineState()
    state.submit(2.0, now=0.0)
    assert state.call("sleep", [1, "keep"], now=1.0) is None
    assert state.request_counts(50.0) == (1, 0)  # asleep: frozen
    assert state.call("wake_up", now=60.0) is True
    assert state.request_counts(60.5) == (1, 0)
    assert state.request_counts(61.0) == (0, 0)
    state.submit(3.0, now=70.0)
    assert state.call("sleep", [1, "wait"], now=70.0) == Deferred(3.0)
    state.call("sleep", [1, "abort"], now=71.0)
    assert state.call("has_work", now=71.0) is False


def test_a_pause_set_on_the_state_holds_the_requests_too() -> None:
    state = EngineState.initial(paused=True)
    state.submit(1.0, now=0.0)
    assert state.request_counts(10.0) == (0, 1)  # a paused scheduler admits nothing
    state.call("resume_scheduler", now=10.0)
    assert state.request_counts(10.0) == (1, 0)


def test_an_engine_without_has_work_says_so_as_vllm_does() -> None:
    state = EngineState(missing_methods=frozenset({"has_work"}))
    state.submit(1.0, now=0.0)
    with pytest.raises(Exception, match="object has no attribute 'has_work'"):
        state.call("has_work", now=0.0)
    assert state.request_counts(0.0) == (1, 0)  # the requests are there all the same
