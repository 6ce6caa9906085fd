"""In-process mode on vLLM's event loop at scale, over an in-memory engine-core client (no
sockets): a fan-out to 100 engines starts its calls in chunks of ``ENGINES_PER_STEP`` with a loop
turn between them (vLLM streams tokens on that loop), and ``VllmCore`` reads vLLM's engine list
and KV-events configs afresh on every call but rebuilds what it made of them only when they
changed (elastic EP, a re-registered engine)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.base.steps import ENGINES_PER_STEP
from exporter.client.fleet import Outcome, connected_count
from exporter.client.inprocess import vllm_core
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore, check_core, rank_of
from exporter.protocol.kv_events import KvEventsSource, parse_kv_events_config

ENGINES = 100


def identity(rank: int) -> bytes:
    return rank.to_bytes(2, "little")


class Ticker:
    """Counts the turns of the event loop another task gets."""

    def __init__(self) -> None:
        self.turns = 0

    async def run(self) -> None:
        while True:
            self.turns += 1
            await asyncio.sleep(0)


class FakeCore:
    """vLLM's engine-core client as far as in-process mode reads it; each call records the
    ticker's count when it started and answers at once."""

    def __init__(self, ranks: list[int], ticker: Ticker | None = None) -> None:
        self.core_engines: list[bytes] = [identity(r) for r in ranks]
        self.utility_results: dict[int, asyncio.Future[Any]] = {}
        self.resources = SimpleNamespace(engine_dead=False)
        self.client_index = 0
        self.ticker = ticker
        #: (method, rank, ticker turns) of every call, in the order they started.
        self.calls: list[tuple[str, int, int]] = []
        #: DP rank → the config object vLLM keeps from its registration.
        self.kv_configs: dict[int, Any] = {}

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        rank = rank_of(engine)
        self.calls.append((method, rank, self.ticker.turns if self.ticker else 0))
        return rank % 3 == 0  # is_sleeping: every third engine

    def get_kv_event_sources(self) -> dict[int, Any]:
        return dict(self.kv_configs)


@pytest.fixture
async def ticker() -> AsyncIterator[Ticker]:
    ticker = Ticker()
    task = asyncio.create_task(ticker.run())
    await asyncio.sleep(0)
    yield ticker
    task.cancel()


def shuffled(n: int) -> list[int]:
    """0..n-1, not in rank order (vLLM's list is in registration order)."""
    return [(r * 37) % n for r in range(n)]


def test_the_fake_is_an_engine_core_client_in_process_mode_accepts() -> None:
    check_core(FakeCore([0]))


async def test_a_fan_out_to_100_engines_answers_each_in_rank_order(ticker: Ticker) -> None:
    core = FakeCore(shuffled(ENGINES), ticker)
    client = InProcessFleetClient(VllmCore(core))
    got = await client.call_utility("is_sleeping", timeout_s=5)
    assert [o.engine for o in got] == [str(r) for r in range(ENGINES)]
    assert all(o.outcome is Outcome.OK for o in got)
    assert [o.value for o in got] == [r % 3 == 0 for r in range(ENGINES)]
    assert sorted(rank for _, rank, _ in core.calls) == list(range(ENGINES))
    assert client.in_flight == {}


async def test_the_loop_turns_while_a_fan_out_starts_its_calls(ticker: Ticker) -> None:
    core = FakeCore(list(range(ENGINES)), ticker)
    client = InProcessFleetClient(VllmCore(core))
    await client.call_utility("is_sleeping", timeout_s=5)
    turns = [t for _, _, t in core.calls]
    assert len(turns) == ENGINES
    # Started in rank order, the other task running between the chunks.
    assert [rank for _, rank, _ in core.calls] == list(range(ENGINES))
    assert turns == sorted(turns)
    assert turns[-1] > turns[0]
    assert len(set(turns)) >= ENGINES // ENGINES_PER_STEP
    # No more than a chunk's calls start within one turn.
    assert max(turns.count(t) for t in set(turns)) <= ENGINES_PER_STEP


async def test_an_engine_subset_is_asked_alone_in_rank_order(ticker: Ticker) -> None:
    core = FakeCore(shuffled(ENGINES), ticker)
    client = InProcessFleetClient(VllmCore(core))
    got = await client.call_utility("is_sleeping", timeout_s=5, engines=["99", "3", "50", "77"])
    assert [(o.engine, o.value) for o in got] == [
        ("3", True),
        ("50", False),
        ("77", False),
        ("99", True),
    ]
    assert sorted(rank for _, rank, _ in core.calls) == [3, 50, 77, 99]
    core.calls.clear()
    evens = [str(r) for r in range(0, ENGINES, 2)]  # more than a chunk
    got = await client.call_utility("is_sleeping", timeout_s=5, engines=evens)
    assert [o.engine for o in got] == evens
    assert [o.value for o in got] == [int(e) % 3 == 0 for e in evens]
    assert sorted(rank for _, rank, _ in core.calls) == list(range(0, ENGINES, 2))
    # A name that is no engine is not asked and not answered.
    assert await client.call_utility("is_sleeping", timeout_s=5, engines=["100"]) == []


def labels(core: VllmCore) -> list[str]:
    return [label for label, _ in core.engines()]


def test_engines_are_rebuilt_only_when_vllms_list_changes() -> None:
    fake = FakeCore([2, 0, 1])
    core = VllmCore(fake)
    first = core.engines()
    assert first == [("0", identity(0)), ("1", identity(1)), ("2", identity(2))]
    assert core.engines() is first  # unchanged: the same list
    fake.core_engines.append(identity(300))  # elastic EP adds an engine (the same list object)
    grown = core.engines()
    assert grown is not first
    assert grown == [*first, ("300", identity(300))]
    assert first == [("0", identity(0)), ("1", identity(1)), ("2", identity(2))]  # untouched
    assert core.engines() is grown
    fake.core_engines = [identity(300), identity(2), identity(0)]  # a new list: 1 left
    shrunk = core.engines()
    assert shrunk == [("0", identity(0)), ("2", identity(2)), ("300", identity(300))]
    fake.core_engines.remove(identity(0))
    assert labels(core) == ["2", "300"]
    fake.core_engines[0] = identity(7)  # replaced in place, same length: [7, 2]
    assert labels(core) == ["2", "7"]
    fake.core_engines.clear()
    assert core.engines() == []


async def test_the_client_follows_engines_that_come_and_go(ticker: Ticker) -> None:
    fake = FakeCore(list(range(ENGINES)), ticker)
    client = InProcessFleetClient(VllmCore(fake))
    assert len(await client.call_utility("is_sleeping", timeout_s=5)) == ENGINES
    fake.core_engines.remove(identity(40))
    fake.core_engines.append(identity(ENGINES))
    got = await client.call_utility("is_sleeping", timeout_s=5)
    expected = [str(r) for r in range(ENGINES + 1) if r != 40]
    assert [o.engine for o in got] == expected
    assert client.engine_labels == expected
    assert connected_count(client) == ENGINES


def kv_config(host: str, topic: str = "kv") -> SimpleNamespace:
    """vLLM's ``KVEventsConfig`` (the fields in-process mode reads, and one it does not)."""
    return SimpleNamespace(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://{host}:5557",
        replay_endpoint=None,
        topic=topic,
        buffer_steps=10_000,
    )


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every config ``kv_event_sources`` parsed, in order."""
    seen: list[Any] = []

    def counted(value: Any, engine_host: str | None = None) -> KvEventsSource | None:
        seen.append(value)
        return parse_kv_events_config(value, engine_host)

    monkeypatch.setattr(vllm_core, "parse_kv_events_config", counted)
    return seen


def test_a_ranks_kv_config_is_parsed_again_only_when_vllm_replaced_it(parses: list[Any]) -> None:
    fake = FakeCore([0, 1, 2, 3])
    fake.kv_configs = {
        0: kv_config("10.0.0.1"),
        1: kv_config("10.0.0.2"),
        2: None,  # publishes nothing
        3: {"enable_kv_cache_events": "yes"},  # unreadable
    }
    core = VllmCore(fake)
    first = core.kv_event_sources()
    assert sorted(first) == ["0", "1"]
    assert first["0"].endpoint == "tcp://10.0.0.1:5557"
    assert first["1"].endpoint == "tcp://10.0.0.2:5557"
    assert first["0"].topic == "kv"
    assert len(parses) == 4
    again = core.kv_event_sources()
    assert again == first
    assert again["0"] is first["0"] and again["1"] is first["1"]  # the same sources
    assert len(parses) == 4  # none parsed again, not even the unreadable one
    fake.kv_configs[1] = kv_config("10.0.0.9", topic="moved")  # rank 1 registered again
    moved = core.kv_event_sources()
    assert moved["0"] is first["0"]
    assert moved["1"].endpoint == "tcp://10.0.0.9:5557" and moved["1"].topic == "moved"
    assert len(parses) == 5
    fake.kv_configs[2] = kv_config("10.0.0.3")  # None → a publisher
    assert core.kv_event_sources()["2"].endpoint == "tcp://10.0.0.3:5557"
    del fake.kv_configs[0]  # rank 0 gone
    assert sorted(core.kv_event_sources()) == ["1", "2"]
    assert len(parses) == 6


def test_engine_details_show_a_replaced_kv_config(parses: list[Any]) -> None:
    fake = FakeCore([0, 1])
    fake.kv_configs = {0: kv_config("10.0.0.1"), 1: kv_config("10.0.0.2")}
    client = InProcessFleetClient(VllmCore(fake))
    before = {d.engine: d.kv_events for d in client.engine_details()}
    assert {e: s.endpoint for e, s in before.items() if s} == {
        "0": "tcp://10.0.0.1:5557",
        "1": "tcp://10.0.0.2:5557",
    }
    fake.kv_configs[0] = kv_config("10.0.0.7")
    after = {d.engine: d.kv_events for d in client.engine_details()}
    assert after["0"] is not None and after["0"].endpoint == "tcp://10.0.0.7:5557"
    assert after["1"] is before["1"]
    assert len(parses) == 3


async def test_a_close_during_the_fan_out_starts_no_further_call() -> None:
    """``close()`` between two chunks: the calls not yet started are never sent (vLLM's
    client would get them after the exporter stopped) and answer ``disconnected``, stopping."""
    core = FakeCore(list(range(ENGINES)))
    client = InProcessFleetClient(VllmCore(core))

    async def close_soon() -> None:
        await asyncio.sleep(0)  # the fan-out has started its first chunk
        await client.close()

    closing = asyncio.create_task(close_soon())
    outcomes = await client.call_utility("is_sleeping", timeout_s=5)
    await closing
    assert [o.engine for o in outcomes] == [str(r) for r in range(ENGINES)]
    started = {rank for _, rank, _ in core.calls}
    assert 0 < len(started) < ENGINES, len(started)
    not_sent = [o for o in outcomes if int(o.engine) not in started]
    assert not_sent and all(o.outcome is Outcome.DISCONNECTED for o in not_sent), not_sent
    assert all("stopping" in (o.error or "") for o in not_sent), not_sent[0]


def test_a_config_whose_comparison_raises_reads_as_no_sources() -> None:
    """vLLM's config objects are compared with the last ones: one whose ``__eq__`` raises is
    another vLLM's shape, nothing to report, never an error on vLLM's loop."""

    class Hostile:
        def __eq__(self, other: object) -> bool:
            raise RuntimeError("no comparing me")

        __hash__ = object.__hash__

    core = FakeCore([0])
    vllm = VllmCore(core)
    core.kv_configs = {0: Hostile()}
    vllm.kv_event_sources()  # the first read: nothing to compare with yet
    core.kv_configs = {0: Hostile()}
    assert vllm.kv_event_sources() == {}
