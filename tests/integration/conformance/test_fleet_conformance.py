"""What every attach mode promises through ``FleetClient``, checked on every kind of fleet.

One test per promise, parametrised (``fleet_kind``) over the fake (the socket-free reference),
owner, relay, HTTP, HTTP over a plugin-enabled server and in-process mode, each over three
engines on 127.0.0.1. Where a mode documents another outcome than the others (vLLM's front end
failing as a whole when one engine dies; HTTP mode not marking ``shutting_down``), the kind says
so (``FleetKind``) and the test asserts the mode's own promise; where a kind cannot produce a
fault at all, its hook skips the test with the reason; where a kind breaks a promise today (a
product bug, ``FleetKind.known_gaps``), the test is a strict xfail for that kind. Every wait is
bounded; timings are checked only against generous upper bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from exporter.client.fleet import (
    READ_METHODS,
    SHUTTING_DOWN,
    STOPPING,
    EngineOutcome,
    Outcome,
    connected_count,
)
from exporter.client.observe import counters_of, unexpected_engines
from exporter.error import MethodNotAllowed
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING, is_cut
from tests.harness.fleet_kinds import ENGINE_STRINGS, ENGINES, EVERY_READ_METHOD, FleetKind
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(60)

#: A fan-out's deadline in the timing tests.
TIMEOUT_S = 1.0
#: A generous bound on a fan-out's wall time beyond its deadline (a shared 2-core machine).
SLACK_S = 2.0
#: The deadline of calls that must simply be answered.
ANSWER_S = 5.0
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def kinds(outcomes: list[EngineOutcome]) -> list[Outcome]:
    return [o.outcome for o in outcomes]


def expect_gap(kind: FleetKind, promise: str, request: pytest.FixtureRequest) -> None:
    """A promise ``kind`` breaks today (``FleetKind.known_gaps``): this test is a strict xfail
    for it, so the fix of the product fails the test until the known gap is removed."""
    reason = kind.known_gaps.get(promise)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=f"{kind.name}: {reason}", strict=True))


async def timed_call(kind: FleetKind, method: str, timeout_s: float) -> list[EngineOutcome]:
    """One fan-out over every engine; it must end within its deadline plus ``SLACK_S``."""
    started = time.monotonic()
    outcomes = await asyncio.wait_for(
        kind.client.call_utility(method, timeout_s=timeout_s), timeout_s + 10
    )
    elapsed = time.monotonic() - started
    assert elapsed < timeout_s + SLACK_S, f"{kind.name}: {elapsed:.2f}s for a {timeout_s}s call"
    assert [o.engine for o in outcomes] == kind.labels
    return outcomes


async def barrier(kind: FleetKind) -> dict[str, int]:
    """One call every engine answers; returns what it added per counter (requests, and each
    engine's where the kind counts them). A request sent before it has been read by then (ZMQ
    keeps a connection's order; HTTP reads its answers in turn), so what the counters say after
    it is final: a negative is proven by a count, not by waiting."""
    before = counts(kind)
    assert kinds(await timed_call(kind, "is_sleeping", ANSWER_S)) == [Outcome.OK] * ENGINES
    after = counts(kind)
    return {key: after[key] - before[key] for key in before}


def counts(kind: FleetKind) -> dict[str, int]:
    """The requests that reached the far side, in all and (where the kind can tell) per engine."""
    found = {"requests": kind.requests()}
    with contextlib.suppress(pytest.skip.Exception):  # a kind that cannot tell per engine
        found.update({f"engine{i}": kind.sent_to(i) for i in range(ENGINES)})
    return found


async def test_every_engine_answers_once_in_engine_order(fleet_kind: FleetKind) -> None:
    client = fleet_kind.client
    labels = fleet_kind.labels
    assert len(labels) == ENGINES
    assert [d.engine for d in client.engine_details()] == labels
    assert connected_count(client) == ENGINES
    outcomes = await timed_call(fleet_kind, "is_sleeping", ANSWER_S)
    assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, False)] * ENGINES
    assert all(o.error is None and not o.shutting_down for o in outcomes)


async def test_every_read_method_is_answered_by_every_engine(
    fleet_kind: FleetKind, request: pytest.FixtureRequest
) -> None:
    expect_gap(fleet_kind, EVERY_READ_METHOD, request)
    expected = {
        "is_sleeping": False,
        "is_scheduler_paused": False,
        "get_weight_version": None,
        "has_work": False,
        "is_inference_ready": True,  # asked on demand only; HTTP mode has no route for it
        "checkpoint_state": ["running", None],  # vLLM 0.34's; an older engine lacks it
    }
    assert set(expected) == READ_METHODS
    for method, value in expected.items():
        if method not in fleet_kind.client.capabilities.methods:
            continue
        outcomes = await timed_call(fleet_kind, method, ANSWER_S)
        if method == "checkpoint_state" and all(is_unsupported(o) for o in outcomes):
            continue  # simulated engines of an older vLLM (their default): unsupported
        assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, value)] * ENGINES, (
            method,
            outcomes,
        )


@pytest.mark.parametrize(
    ("method", "args"), [("collective_rpc", ("reload_weights",)), ("shutdown", ())]
)
async def test_a_method_off_the_allow_list_is_refused_before_anything_is_sent(
    fleet_kind: FleetKind, method: str, args: tuple[str, ...]
) -> None:
    client = fleet_kind.client
    cost = await barrier(fleet_kind)  # what one answered call adds to the counters
    before = counts(fleet_kind)
    assert method not in client.capabilities.methods
    with pytest.raises(MethodNotAllowed, match=method):
        await client.call_utility(method, args, timeout_s=ANSWER_S)
    with pytest.raises(MethodNotAllowed, match=method):
        await client.call_utility(method, args, timeout_s=ANSWER_S, engines=fleet_kind.labels[:1])
    # The client is unharmed (every engine answers the next call), and it alone reached them.
    await barrier(fleet_kind)
    assert counts(fleet_kind) == {key: before[key] + cost[key] for key in before}


async def test_the_engines_filter_answers_those_engines_in_engine_order(
    fleet_kind: FleetKind,
) -> None:
    client = fleet_kind.client
    first, middle, last = fleet_kind.labels
    got = await client.call_utility("is_sleeping", timeout_s=ANSWER_S, engines=[last, first])
    assert [(o.engine, o.outcome) for o in got] == [(first, Outcome.OK), (last, Outcome.OK)]
    # An unknown label is no engine: every mode leaves it out (no outcome, nothing sent).
    got = await client.call_utility(
        "is_sleeping", timeout_s=ANSWER_S, engines=["no-such-engine", middle]
    )
    assert [(o.engine, o.outcome) for o in got] == [(middle, Outcome.OK)]
    cost = await barrier(fleet_kind)
    before = counts(fleet_kind)
    assert await client.call_utility("is_sleeping", timeout_s=ANSWER_S, engines=[]) == []
    assert await client.call_utility("is_sleeping", timeout_s=ANSWER_S, engines=["nope"]) == []
    await barrier(fleet_kind)  # nothing was sent: the counters moved by the barrier alone
    assert counts(fleet_kind) == {key: before[key] + cost[key] for key in before}


async def test_the_engines_filter_sends_to_those_engines_only(fleet_kind: FleetKind) -> None:
    before = [fleet_kind.sent_to(i) for i in range(ENGINES)]
    first, _, last = fleet_kind.labels
    got = await fleet_kind.client.call_utility(
        "is_sleeping", timeout_s=ANSWER_S, engines=[first, last]
    )
    assert kinds(got) == [Outcome.OK, Outcome.OK]
    await fleet_kind.client.call_utility("is_sleeping", timeout_s=ANSWER_S, engines=[])
    await barrier(fleet_kind)  # one more request each: anything sent before has been read
    assert [fleet_kind.sent_to(i) - before[i] for i in range(ENGINES)] == [2, 1, 2]


@pytest.mark.parametrize("position", list(POSITIONS))
async def test_a_hung_engine_times_out_alone_within_the_shared_deadline(
    fleet_kind: FleetKind, position: str
) -> None:
    hung = POSITIONS[position]
    await fleet_kind.hang(hung)
    outcomes = await timed_call(fleet_kind, "is_sleeping", TIMEOUT_S)
    for i, o in enumerate(outcomes):
        if i == hung:
            assert o.outcome is Outcome.TIMEOUT, o
            assert o.error, o
        else:
            assert (o.outcome, o.value) == (Outcome.OK, False), o


async def test_a_dead_engine_is_disconnected_and_the_others_answer(
    fleet_kind: FleetKind,
) -> None:
    dead = 1
    await fleet_kind.disconnect(dead)
    outcomes = await timed_call(fleet_kind, "is_sleeping", TIMEOUT_S)
    assert outcomes[dead].outcome is Outcome.DISCONNECTED, outcomes[dead]
    assert outcomes[dead].error, outcomes[dead]
    others = [o for i, o in enumerate(outcomes) if i != dead]
    if fleet_kind.death_takes_all:
        # vLLM's front end fails as a whole when one engine dies (in-process mode, and so a
        # plugin-enabled server): every engine is disconnected from then on.
        assert kinds(others) == [Outcome.DISCONNECTED] * (ENGINES - 1), others
        assert connected_count(fleet_kind.client) == 0
    else:
        assert [(o.outcome, o.value) for o in others] == [(Outcome.OK, False)] * (ENGINES - 1)
        assert connected_count(fleet_kind.client) == ENGINES - 1
    details = {d.engine: d.connected for d in fleet_kind.client.engine_details()}
    assert details[fleet_kind.labels[dead]] is False


async def test_a_failing_engine_is_failed_with_its_error_text(fleet_kind: FleetKind) -> None:
    text = "CUDA error: out of memory"
    await fleet_kind.fail(1, text)
    outcomes = await timed_call(fleet_kind, "is_sleeping", ANSWER_S)
    failed = outcomes[1]
    assert failed.outcome is Outcome.FAILED, failed
    assert failed.error is not None and text in failed.error, failed
    if fleet_kind.failure_text_as_sent:
        assert failed.error == text
    assert failed.shutting_down is False
    assert kinds([outcomes[0], outcomes[2]]) == [Outcome.OK, Outcome.OK]


async def test_a_shutting_down_engine_is_failed_and_marked_where_the_mode_can_tell(
    fleet_kind: FleetKind,
) -> None:
    await fleet_kind.shut_down(2)
    outcomes = await timed_call(fleet_kind, "is_sleeping", ANSWER_S)
    closing = outcomes[2]
    assert closing.outcome is Outcome.FAILED, closing
    assert closing.error is not None and SHUTTING_DOWN in closing.error, closing
    if fleet_kind.failure_text_as_sent:
        assert closing.error == SHUTTING_DOWN
    # HTTP mode (and so a plugin-enabled server) never marks it: see the kind.
    assert closing.shutting_down is fleet_kind.flags_shutting_down, closing
    assert kinds(outcomes[:2]) == [Outcome.OK, Outcome.OK]


#: 1 MB of UTF-8, some characters two bytes long (a ZMQ output frame holds 1 MiB).
LONG = "weight-ü-" * 100_000


def assert_cut(text: object) -> None:
    """``text`` is ``LONG`` cut: at most 256 bytes of UTF-8, its head, then the marker."""
    assert isinstance(text, str)
    assert len(text.encode()) <= MAX_ENGINE_STRING, len(text.encode())
    assert is_cut(text), text[-40:]
    kept = text[: text.index(CUT_MARKER)]
    assert kept and LONG.startswith(kept), kept


async def test_a_long_engine_string_is_cut_to_256_bytes_with_the_marker(
    fleet_kind: FleetKind, request: pytest.FixtureRequest
) -> None:
    expect_gap(fleet_kind, ENGINE_STRINGS, request)
    expect_gap(fleet_kind, EVERY_READ_METHOD, request)  # the string is a weight version
    await fleet_kind.answer_long(0, LONG)
    outcomes = await timed_call(fleet_kind, "get_weight_version", ANSWER_S)
    assert outcomes[0].outcome is Outcome.OK, outcomes[0]
    assert_cut(outcomes[0].value)
    assert kinds(outcomes[1:]) == [Outcome.OK, Outcome.OK]


async def test_a_long_failure_text_is_cut_to_256_bytes_with_the_marker(
    fleet_kind: FleetKind, request: pytest.FixtureRequest
) -> None:
    expect_gap(fleet_kind, ENGINE_STRINGS, request)
    await fleet_kind.fail(2, LONG)
    outcomes = await timed_call(fleet_kind, "is_sleeping", ANSWER_S)
    failed = outcomes[2]
    assert failed.outcome is Outcome.FAILED, failed
    assert failed.error is not None and len(failed.error.encode()) <= MAX_ENGINE_STRING
    assert is_cut(failed.error), failed.error[-40:]
    assert kinds(outcomes[:2]) == [Outcome.OK, Outcome.OK]


async def test_close_ends_the_calls_in_flight_and_leaves_nothing_pending(
    fleet_kind: FleetKind,
) -> None:
    hung = 1
    await fleet_kind.hang(hung)
    asked = fleet_kind.asked(hung)
    call = asyncio.ensure_future(fleet_kind.client.call_utility("is_sleeping", timeout_s=30.0))
    await eventually(lambda: fleet_kind.asked(hung) > asked, 5.0, "the hung engine asked")
    started = time.monotonic()
    await asyncio.wait_for(fleet_kind.close_client(), 5.0)
    outcomes = await asyncio.wait_for(call, 5.0)
    assert time.monotonic() - started < SLACK_S, "the call waited for its 30 s deadline"
    assert [o.engine for o in outcomes] == fleet_kind.labels
    assert (outcomes[hung].outcome, outcomes[hung].error) == (Outcome.DISCONNECTED, STOPPING)
    await eventually(lambda: fleet_kind.pending() == 0, 5.0, "nothing left pending")


async def test_a_call_after_close_sends_nothing_and_says_the_exporter_is_stopping(
    fleet_kind: FleetKind,
) -> None:
    await asyncio.wait_for(fleet_kind.close_client(), 5.0)
    before = fleet_kind.requests()
    outcomes = await asyncio.wait_for(
        fleet_kind.client.call_utility("is_sleeping", timeout_s=1.0), 5.0
    )
    assert [(o.engine, o.outcome, o.error) for o in outcomes] == [
        (label, Outcome.DISCONNECTED, STOPPING) for label in fleet_kind.labels
    ]
    assert fleet_kind.requests() == before


async def test_an_engine_without_the_method_is_unsupported(
    fleet_kind: FleetKind, request: pytest.FixtureRequest
) -> None:
    expect_gap(fleet_kind, EVERY_READ_METHOD, request)
    await fleet_kind.lack(0, "get_weight_version")
    outcomes = await timed_call(fleet_kind, "get_weight_version", ANSWER_S)
    assert is_unsupported(outcomes[0]), outcomes[0]
    assert kinds(outcomes[1:]) == [Outcome.OK, Outcome.OK]
    assert all(not is_unsupported(o) for o in outcomes[1:])


async def test_capabilities_counters_and_unexpected_engines_are_the_modes_own(
    fleet_kind: FleetKind,
) -> None:
    client = fleet_kind.client
    assert client.capabilities == fleet_kind.capabilities
    assert set(counters_of(client.observations)) == fleet_kind.counter_families
    assert dict(unexpected_engines(client.observations)) == {}
    assert READ_METHODS - {"is_inference_ready"} <= client.capabilities.methods
