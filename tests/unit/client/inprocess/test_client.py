"""``InProcessFleetClient`` and ``VllmCore`` over a stub of vLLM's engine-core client (no
sockets): what the simulation cannot produce (hostile results, odd error types, names a vLLM
release lacks, calls that never resolve, elastic EP changing the engines between calls)."""

from __future__ import annotations

import asyncio
import gc
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.client.fleet import SHUTTING_DOWN, STOPPING, Outcome, connected_count
from exporter.client.inprocess import client as client_module
from exporter.client.inprocess.client import MAX_IN_FLIGHT, InProcessFleetClient
from exporter.client.inprocess.fanout import ENGINE_CORE_DEAD
from exporter.client.inprocess.vllm_core import (
    REQUIRED_NAMES,
    VllmCore,
    check_core,
    engine_core_of,
    is_engine_dead_error,
    rank_of,
)
from exporter.error import ConfigError, MethodNotAllowed
from exporter.protocol.strings import MAX_ENGINE_STRING, MAX_RESULT_NESTING, TOO_DEEP, is_cut

MB = 1_000_000
TIMEOUT = 0.05


class Hang:
    """A reply that never comes: the call's future waits in ``utility_results``."""


HANG = Hang()
#: rank → what the engine answers: a value, an exception (raised), HANG, or a callable
#: ``(method, args) -> value`` (awaited when it returns an awaitable).
Reply = Any


class StubCore:
    """vLLM's engine-core client as far as in-process mode reads it, with vLLM's semantics for
    ``utility_results`` (an entry per call until it resolves)."""

    def __init__(self, ranks: list[int] | None = None, **replies: Reply) -> None:
        self.core_engines: list[bytes] = [r.to_bytes(2, "little") for r in (ranks or [0, 1, 2])]
        self.utility_results: dict[int, asyncio.Future[Any]] = {}
        self.resources = SimpleNamespace(engine_dead=False)
        self.client_index = 0
        self.replies: dict[int, Reply] = {int(k.lstrip("r")): v for k, v in replies.items()}
        self.sent: list[tuple[str, tuple[Any, ...], int]] = []
        self._ids = 0

    def sent_to(self, rank: int) -> int:
        return sum(1 for _, _, r in self.sent if r == rank)

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        rank = int.from_bytes(engine, "little")
        self.sent.append((method, args, rank))
        reply = self.replies.get(rank, True)
        self._ids += 1
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.utility_results[self._ids] = future
        if reply is not HANG:
            self.utility_results.pop(self._ids)
            if isinstance(reply, BaseException):
                raise reply
            if callable(reply):
                value = reply(method, args)
                return await value if asyncio.iscoroutine(value) else value
            return reply
        return await future


def client_of(core: Any, **kwargs: Any) -> InProcessFleetClient:
    return InProcessFleetClient(VllmCore(core), **kwargs)


# -- engines and labels ------------------------------------------------------------------------


async def test_labels_are_ranks_of_little_endian_identities_sorted_by_rank() -> None:
    core = StubCore([10, 256, 2, 1])
    assert core.core_engines[1] == b"\x00\x01"
    assert [rank_of(i) for i in core.core_engines] == [10, 256, 2, 1]
    for rank in (10, 256, 2, 1):
        core.replies[rank] = lambda _m, _a, rank=rank: f"engine {rank}"
    client = client_of(core)
    assert client.engine_labels == ["1", "2", "10", "256"]  # by rank, not as text
    got = await client.call_utility("get_weight_version", timeout_s=TIMEOUT)
    assert [(o.engine, o.value) for o in got] == [
        ("1", "engine 1"),
        ("2", "engine 2"),
        ("10", "engine 10"),
        ("256", "engine 256"),
    ]
    assert sorted(r for _, _, r in core.sent) == [1, 2, 10, 256]


async def test_engines_are_read_afresh_on_every_call() -> None:
    """Elastic EP: vLLM's client changes ``core_engines`` while the exporter runs."""
    core = StubCore([0, 1])
    client = client_of(core)
    assert [o.engine for o in await client.call_utility("is_sleeping", timeout_s=TIMEOUT)] == [
        "0",
        "1",
    ]
    core.core_engines.extend([(3).to_bytes(2, "little"), (2).to_bytes(2, "little")])
    assert client.engine_labels == ["0", "1", "2", "3"]
    assert connected_count(client) == 4
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [o.engine for o in got] == ["0", "1", "2", "3"]
    core.core_engines.remove((0).to_bytes(2, "little"))
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=["0", "3"])
    assert [o.engine for o in got] == ["3"]
    assert [d.engine for d in client.engine_details()] == ["1", "2", "3"]
    assert [r for _, _, r in core.sent] == [0, 1, 0, 1, 2, 3, 3]


async def test_a_burst_asked_again_after_the_engines_changed_is_found_afresh() -> None:
    """A paced poll asks the same bursts every poll (their targets are kept): an engine that
    left between two polls is not called, one that came back is."""
    core = StubCore([0, 1, 2])
    client = client_of(core)
    burst = ("1", "2")
    for _ in range(2):
        got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=burst)
        assert [o.engine for o in got] == ["1", "2"]
    core.core_engines.remove((2).to_bytes(2, "little"))
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=burst)
    assert [o.engine for o in got] == ["1"]
    core.core_engines.append((2).to_bytes(2, "little"))
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=list(burst))
    assert [o.engine for o in got] == ["1", "2"]
    assert [r for _, _, r in core.sent] == [1, 2, 1, 2, 1, 1, 2]


async def test_the_kept_bursts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_module, "MAX_KEPT_TARGETS", 8)
    core = StubCore(list(range(12)))
    client = client_of(core)
    for size in range(1, 13):
        for start in range(0, 12 - size + 1):
            wanted = [str(r) for r in range(start, start + size)]
            got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT, engines=wanted)
            assert [o.engine for o in got] == wanted
    assert 0 < len(client._targets_of[1]) <= 8
    assert len(core.sent) == sum(size * (13 - size) for size in range(1, 13))


# -- results and errors ------------------------------------------------------------------------


def nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return value


async def test_huge_and_deep_results_are_bounded() -> None:
    big = "x" * MB
    core = StubCore(
        r0=big,
        r1=big[:-1] + "y",  # differs only at its end
        r2={"k" * MB: ["v" * MB, b"\x00" * MB]},
        r3=nested(1000),
    )
    core.core_engines.append((3).to_bytes(2, "little"))
    client = client_of(core)
    got = await client.call_utility("get_weight_version", timeout_s=TIMEOUT)
    assert [o.outcome for o in got] == [Outcome.OK] * 4
    first, second = got[0].value, got[1].value
    assert is_cut(first) and len(first.encode()) <= MAX_ENGINE_STRING
    assert first != second  # the digest keeps them apart: no false consensus
    ((key, (text, data)),) = got[2].value.items()
    assert is_cut(key) and len(key.encode()) <= MAX_ENGINE_STRING
    assert is_cut(text) and len(data) <= MAX_ENGINE_STRING
    depth, value = 0, got[3].value
    while isinstance(value, list):
        (value,) = value
        depth += 1
    assert (depth, value) == (MAX_RESULT_NESTING, TOO_DEEP)


async def test_failure_message_is_failed_and_bounded() -> None:
    core = StubCore(r0=Exception("E" * MB), r1=Exception("no such tag 'kv'"))
    core.replies[2] = Exception(SHUTTING_DOWN)
    got = await client_of(core).call_utility("wake_up", (["kv"],), timeout_s=TIMEOUT)
    assert [o.outcome for o in got] == [Outcome.FAILED] * 3
    assert got[0].error is not None and is_cut(got[0].error)
    assert len(got[0].error.encode()) <= MAX_ENGINE_STRING
    assert got[1].error == "no such tag 'kv'" and not got[1].shutting_down
    assert got[2].shutting_down
    assert core.sent[0] == ("wake_up", (["kv"],), 0)


class Unusual(BaseException):
    """Not an ``Exception`` at all."""


class VllmSubclassError(Exception):
    """A subclass is not vLLM's plain-``Exception`` failure wrapper."""


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad frame"),
        ConnectionResetError("socket closed"),
        VllmSubclassError("wrapped"),
        Unusual("odd"),
        RuntimeError("R" * MB),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_any_other_error_is_disconnected(error: BaseException) -> None:
    core = StubCore(r1=error)
    got = await client_of(core).call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [o.outcome for o in got] == [Outcome.OK, Outcome.DISCONNECTED, Outcome.OK]
    message = got[1].error
    assert message is not None and message.startswith(f"{type(error).__name__}: ")
    assert len(message.encode()) <= MAX_ENGINE_STRING
    assert not core.resources.engine_dead  # only vLLM marks itself dead


class NotACoroutineCore(StubCore):
    """A vLLM whose ``_call_utility_async`` is no coroutine function: rank 0's call raises
    when made, rank 1's returns a future, rank 2's something that cannot be awaited."""

    def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        rank = int.from_bytes(engine, "little")
        self.sent.append((method, args, rank))
        if rank == 0:
            raise Exception("raised when called")
        if rank == 1:
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            future.set_result(True)
            return future
        return object()


async def test_a_call_that_is_not_vllms_coroutine_fails_its_engine_only() -> None:
    """Whatever vLLM's call is made of, its failure is that engine's outcome, never an
    error raised into the fan-out (or vLLM's loop)."""
    got = await client_of(NotACoroutineCore()).call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [o.outcome for o in got] == [Outcome.FAILED, Outcome.OK, Outcome.DISCONNECTED]
    assert got[0].error == "raised when called" and got[1].value is True
    assert got[2].error is not None and got[2].error.startswith("TypeError: ")


async def test_engine_dead_error_is_recognised_by_class_name() -> None:
    class EngineDeadError(Exception):
        pass

    class LaterEngineDeadError(EngineDeadError):
        pass

    assert is_engine_dead_error(EngineDeadError())
    assert is_engine_dead_error(LaterEngineDeadError())
    assert not is_engine_dead_error(Exception("EngineDeadError"))
    core = StubCore(r0=EngineDeadError(), r2=LaterEngineDeadError())
    got = await client_of(core).call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [o.outcome for o in got] == [Outcome.DISCONNECTED, Outcome.OK, Outcome.DISCONNECTED]
    assert got[0].error == ENGINE_CORE_DEAD and got[2].error == ENGINE_CORE_DEAD


async def test_a_future_vllm_cancels_is_disconnected() -> None:
    core = StubCore(r1=HANG)
    client = client_of(core)
    pending = asyncio.ensure_future(client.call_utility("is_sleeping", timeout_s=1.0))
    for _ in range(10):
        await asyncio.sleep(0)
    (future,) = core.utility_results.values()
    future.cancel()  # vLLM's client shutting down
    got = await asyncio.wait_for(pending, 1)
    assert (got[1].outcome, got[1].error) == (Outcome.DISCONNECTED, "call cancelled")
    assert client.in_flight == {}


async def test_an_engine_dead_core_is_disconnected_everywhere_without_sending() -> None:
    core = StubCore()
    core.resources.engine_dead = True
    client = client_of(core)
    got = await client.call_utility("is_sleeping", timeout_s=TIMEOUT)
    assert [(o.outcome, o.error) for o in got] == [(Outcome.DISCONNECTED, ENGINE_CORE_DEAD)] * 3
    assert core.sent == []
    assert connected_count(client) == 0
    assert [d.connected for d in client.engine_details()] == [False] * 3


async def test_a_method_off_the_allow_list_is_refused_before_sending() -> None:
    core = StubCore()
    client = client_of(core, allowed_methods=frozenset({"is_sleeping"}))
    for method in ("reset_prefix_cache", "collective_rpc", "shutdown"):
        with pytest.raises(MethodNotAllowed, match=method):
            await client.call_utility(method, timeout_s=TIMEOUT)
    assert core.sent == [] and client.in_flight == {}


async def test_each_engine_reports_its_own_round_trip() -> None:
    async def slow(_m: str, _a: tuple[Any, ...]) -> bool:
        await asyncio.sleep(0.2)
        return True

    core = StubCore(r0=slow, r1=HANG)
    got = await client_of(core).call_utility("is_sleeping", timeout_s=1.0)
    assert [o.outcome for o in got] == [Outcome.OK, Outcome.TIMEOUT, Outcome.OK]
    assert got[0].duration_s is not None and 0.2 <= got[0].duration_s < 1.0
    # Neither the slow one's nor the hung one's wait.
    assert got[2].duration_s is not None and got[2].duration_s < 0.2
    assert got[1].duration_s == 1.0


# -- the bound on vLLM's table, close() ---------------------------------------------------------


async def test_in_flight_bound_is_exactly_max_in_flight() -> None:
    assert MAX_IN_FLIGHT == 12
    core = StubCore(r0=HANG)
    client = client_of(core)
    for n in range(1, MAX_IN_FLIGHT + 1):
        got = await client.call_utility("is_sleeping", timeout_s=0.01)
        assert (got[0].outcome, got[0].error) == (Outcome.TIMEOUT, "no reply within 0.01s")
        assert client.in_flight == {"0": n}
    assert core.sent_to(0) == MAX_IN_FLIGHT and len(core.utility_results) == MAX_IN_FLIGHT

    # The 13th and later: not sent, answered at once; the other engines are still asked.
    for _ in range(3):
        got = await client.call_utility("is_sleeping", timeout_s=0.01)
        assert got[0].outcome is Outcome.TIMEOUT and got[0].duration_s == 0.0
        assert (
            got[0].error == f"not sent: {MAX_IN_FLIGHT} earlier calls to this engine are unanswered"
        )
        assert [o.outcome for o in got[1:]] == [Outcome.OK, Outcome.OK]
    assert core.sent_to(0) == MAX_IN_FLIGHT and core.sent_to(1) == MAX_IN_FLIGHT + 3
    assert len(core.utility_results) == MAX_IN_FLIGHT

    # One late reply frees one slot (vLLM pops its entry), and exactly one more call is sent.
    call_id, future = next(iter(core.utility_results.items()))
    core.utility_results.pop(call_id)
    future.set_result(False)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert client.in_flight == {"0": MAX_IN_FLIGHT - 1}
    await client.call_utility("is_sleeping", timeout_s=0.01)
    got = await client.call_utility("is_sleeping", timeout_s=0.01)
    assert got[0].error is not None and got[0].error.startswith("not sent")
    assert core.sent_to(0) == MAX_IN_FLIGHT + 1
    await client.close()


async def test_concurrent_calls_respect_the_bound() -> None:
    core = StubCore(r1=HANG)
    client = client_of(core, max_in_flight=3)
    results = await asyncio.gather(
        *(client.call_utility("is_sleeping", timeout_s=0.05) for _ in range(10))
    )
    errors = [r[1].error or "" for r in results]
    assert sum(e.startswith("no reply") for e in errors) == 3
    assert sum(e.startswith("not sent: 3 earlier") for e in errors) == 7
    assert core.sent_to(1) == 3
    # The bound counts every unanswered call, a healthy engine's too: ten calls started at
    # once send three to each engine (the exporter's own callers stay under the default 8).
    assert [r[0].outcome for r in results].count(Outcome.OK) == 3
    assert core.sent_to(0) == 3 and core.sent_to(2) == 3
    await client.close()


async def test_close_cancels_outstanding_calls() -> None:
    core = StubCore(r0=HANG, r2=HANG)
    client = client_of(core)
    for _ in range(3):
        await client.call_utility("is_sleeping", timeout_s=0.01)
    assert client.in_flight == {"0": 3, "2": 3}
    futures = list(core.utility_results.values())
    await client.close()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert client.in_flight == {}
    assert all(f.cancelled() for f in futures)  # vLLM drops a late reply to these
    sent = len(core.sent)
    got = await client.call_utility("is_sleeping", timeout_s=0.01)
    assert [(o.outcome, o.error) for o in got] == [
        (Outcome.DISCONNECTED, "the exporter is stopping")
    ] * 3
    assert len(core.sent) == sent
    await client.start()
    got = await client.call_utility("is_sleeping", timeout_s=0.01)
    assert got[1].outcome is Outcome.OK and len(core.sent) == sent + 3
    await client.close()


async def test_close_reaches_calls_of_a_fan_out_still_waiting() -> None:
    core = StubCore(r1=HANG)
    client = client_of(core)
    pending = asyncio.ensure_future(client.call_utility("is_sleeping", timeout_s=5.0))
    for _ in range(10):
        await asyncio.sleep(0)
    assert client.in_flight == {"1": 1}
    await client.close()
    got = await asyncio.wait_for(pending, 1)
    assert (got[1].outcome, got[1].error) == (Outcome.DISCONNECTED, STOPPING)
    assert client.in_flight == {}


async def test_a_late_failure_is_not_an_unretrieved_exception(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core = StubCore(r0=HANG)
    client = client_of(core)
    await client.call_utility("is_sleeping", timeout_s=0.01)
    ((call_id, future),) = core.utility_results.items()
    core.utility_results.pop(call_id)
    future.set_exception(Exception("answered too late"))
    for _ in range(3):
        await asyncio.sleep(0)
    assert client.in_flight == {}
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
        await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


# -- what a vLLM release must have -------------------------------------------------------------


def full_core(**without: bool) -> SimpleNamespace:
    attrs: dict[str, Any] = {
        "core_engines": [],
        "_call_utility_async": lambda *a, **k: None,
        "utility_results": {},
        "resources": SimpleNamespace(engine_dead=False),
    }
    return SimpleNamespace(**{k: v for k, v in attrs.items() if k not in without})


@pytest.mark.parametrize("missing", REQUIRED_NAMES)
def test_check_core_names_the_missing_attribute(missing: str) -> None:
    core = full_core(**{missing: True})
    with pytest.raises(ConfigError, match=f"SimpleNamespace lacks {missing} "):
        check_core(core)
    with pytest.raises(ConfigError, match=missing):
        VllmCore(core)
    with pytest.raises(ConfigError, match=missing):
        engine_core_of(SimpleNamespace(engine_core=core))


def test_check_core_names_every_missing_attribute() -> None:
    with pytest.raises(ConfigError, match="lacks core_engines, utility_results"):
        check_core(full_core(core_engines=True, utility_results=True))


def test_a_core_without_resources_engine_dead_is_refused() -> None:
    core = full_core()
    core.resources = SimpleNamespace()
    with pytest.raises(ConfigError, match=r"lacks resources\.engine_dead"):
        check_core(core)
    check_core(full_core())  # everything there: accepted


def test_an_engine_client_without_engine_core_is_refused() -> None:
    with pytest.raises(ConfigError, match="Thing has no engine_core"):
        engine_core_of(type("Thing", (), {})())


def test_details_say_what_vllm_said_about_itself() -> None:
    core = StubCore([0, 1])
    core.client_index = 2
    client = InProcessFleetClient(VllmCore(core, vllm_version="0.33.1", enable_sleep_mode=False))
    details = client.engine_details()
    assert [(d.engine, d.connected, d.vllm_version, d.enable_sleep_mode) for d in details] == [
        ("0", True, "0.33.1", False),
        ("1", True, "0.33.1", False),
    ]
    assert details[0].address == "in-process (vLLM client 2)"
