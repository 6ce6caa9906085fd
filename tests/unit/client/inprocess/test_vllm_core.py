"""In-process mode's floor of each rank's requests: the front end's own unfinished requests on it
(vLLM's ``DPLBAsyncMPClient.engine_inflight``, a ``Counter`` by engine identity) count whatever
the coordinator's table says or fails to say (its subscription never started or ended, the
table missing or not a list, an entry unreadable, a table that raises), and an own count that
cannot be read is never a 0: ``has_work`` false from such a rank is not an answer the exporter
calls drained on. A stub of vLLM's engine-core client, no sockets."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.client.fleet import Outcome
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.protocol.activity import MAX_REQUESTS, RequestCounts

TIMEOUT = 1.0
IDS = [r.to_bytes(2, "little") for r in range(3)]


class Raising(list[Any]):
    """A list whose items and length cannot be read (as a hostile object in vLLM's place)."""

    def __getitem__(self, index: Any) -> Any:
        raise RuntimeError("no item")

    def __len__(self) -> int:
        raise RuntimeError("no length")


class RaisingMap(Mapping[Any, Any]):
    """A mapping whose every look-up raises something other than ``KeyError``."""

    def __getitem__(self, key: Any) -> Any:
        raise RuntimeError("no look-up")

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __len__(self) -> int:
        return 3


class DoneRaises:
    def done(self) -> bool:
        raise RuntimeError("no state")


class StubCore:
    """vLLM's DPLB engine-core client as far as the floor reads it: a live subscription and a
    zero table unless a test says otherwise; every engine answers ``has_work`` ``work``."""

    def __init__(self, work: bool = False) -> None:
        self.core_engines = list(IDS)
        self.utility_results: dict[int, Any] = {}
        self.resources = SimpleNamespace(engine_dead=False, stats_update_task=SimpleNamespace())
        self.resources.stats_update_task.done = lambda: False
        self.engine_ranks_managed: Any = [0, 1, 2]
        self.lb_engines: Any = [[0, 0, 0.0] for _ in IDS]
        self.engine_inflight: Any = Counter({IDS[1]: 2})
        self.work = work

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        await asyncio.sleep(0)
        return self.work


def no_subscription(core: StubCore) -> None:
    core.resources.stats_update_task = None


def subscription_ended(core: StubCore) -> None:
    # vLLM 0.33's run_engine_stats_update_task ends on a publication it cannot unpack.
    core.resources.stats_update_task.done = lambda: True


def done_raises(core: StubCore) -> None:
    core.resources.stats_update_task = DoneRaises()


def no_table(core: StubCore) -> None:
    del core.lb_engines


def table_not_a_list(core: StubCore) -> None:
    core.lb_engines = "garbage"


def managed_not_a_list(core: StubCore) -> None:
    core.engine_ranks_managed = None


def entry_unreadable(core: StubCore) -> None:
    core.lb_engines = [[0, 0, 0.0], ["x", -1, 0.0], [0, 0, 0.0]]


def table_raises(core: StubCore) -> None:
    core.lb_engines = Raising([[0, 0, 0.0]] * 3)


def table_live(core: StubCore) -> None:
    """The table reads, and says nothing of the rank's requests (a keep pause hides them)."""


TABLE_STATES = {
    "no subscription": no_subscription,
    "subscription ended": subscription_ended,
    "done() raises": done_raises,
    "no table": no_table,
    "table not a list": table_not_a_list,
    "managed ranks not a list": managed_not_a_list,
    "entry unreadable": entry_unreadable,
    "table raises": table_raises,
    "table live": table_live,
}


@pytest.mark.parametrize("state", TABLE_STATES)
def test_the_front_ends_own_requests_count_whatever_the_table(state: str) -> None:
    core = StubCore()
    TABLE_STATES[state](core)
    found = VllmCore(core).request_counts([0, 1, 2])
    assert found.get(1) == RequestCounts(2, 0)
    # The others hold none of this front end's requests: nothing is claimed for them.
    assert found.get(0) in (None, RequestCounts(0, 0)) and found.get(2) == found.get(0)


@pytest.mark.parametrize("state", TABLE_STATES)
async def test_has_work_false_with_held_requests_is_not_drained(state: str) -> None:
    """Through the client: ``has_work`` stays vLLM's answer and the rank's counts say work."""
    core = StubCore()
    TABLE_STATES[state](core)
    client = InProcessFleetClient(VllmCore(core))
    outcomes = await client.call_utility("has_work", timeout_s=TIMEOUT)
    assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, False)] * 3
    requests = {d.engine: d.requests for d in client.engine_details()}
    assert requests["1"] == RequestCounts(2, 0)


def test_the_floor_raises_the_coordinators_counts_to_the_own_count() -> None:
    core = StubCore()
    core.lb_engines = [[0, 0, 0.0], [1, 0, 0.0], [0, 5, 0.0]]
    core.engine_inflight = Counter({IDS[1]: 3, IDS[2]: 1})
    found = VllmCore(core).request_counts([0, 1, 2])
    assert found == {0: RequestCounts(0, 0), 1: RequestCounts(2, 1), 2: RequestCounts(5, 0)}


def test_an_in_flight_count_by_position_is_read_too() -> None:
    core = StubCore()
    no_subscription(core)
    core.engine_inflight = [0, 0, 4]  # a list in core_engines' order
    assert VllmCore(core).request_counts([0, 1, 2]) == {2: RequestCounts(4, 0)}


#: What vLLM's ``engine_inflight`` may hold instead of a count for rank 1 (the others' fine).
HOSTILE_INFLIGHT: dict[str, tuple[Any, list[int]]] = {
    "negative": (Counter({IDS[1]: -2}), [1]),
    "huge": (Counter({IDS[1]: MAX_REQUESTS + 1}), [1]),
    "float huge": ({IDS[1]: 1e30}, [1]),
    "fraction": ({IDS[1]: 1.5}, [1]),
    "nan": ({IDS[1]: float("nan")}, [1]),
    "string": ({IDS[1]: "2"}, [1]),
    "bool": ({IDS[1]: True}, [1]),
    "none": ({IDS[1]: None}, [1]),
    "raising look-up": (RaisingMap(), [0, 1, 2]),
    "not a map": ("not a map", [0, 1, 2]),
    "a number": (7, [0, 1, 2]),
    "list of the wrong length": ([0, 2], [0, 1, 2]),
    "list that raises": (Raising([0, 0, 0]), [0, 1, 2]),
}


@pytest.mark.parametrize("case", HOSTILE_INFLIGHT)
@pytest.mark.parametrize("table", ["table live", "subscription ended"])
async def test_an_unreadable_own_count_is_never_drained(case: str, table: str) -> None:
    """vLLM answers ``has_work`` false, but the front end's own count of the rank cannot be
    read: the rank's ``has_work`` is unknown (failed, saying why), never a drained false;
    nothing raises on vLLM's loop."""
    inflight, unreadable = HOSTILE_INFLIGHT[case]
    core = StubCore()
    TABLE_STATES[table](core)
    core.engine_inflight = inflight
    client = InProcessFleetClient(VllmCore(core))
    outcomes = await client.call_utility("has_work", timeout_s=TIMEOUT)
    failed = [int(o.engine) for o in outcomes if o.outcome is Outcome.FAILED]
    assert failed == unreadable, outcomes
    assert all(o.value is False for o in outcomes if int(o.engine) not in unreadable)
    assert all(
        "engine_inflight" in (o.error or "") for o in outcomes if o.outcome is Outcome.FAILED
    )
    details = client.engine_details()  # never raises either
    assert all(d.requests is None or d.requests.total == 0 for d in details)


async def test_has_work_true_stays_whatever_the_own_count() -> None:
    core = StubCore(work=True)
    core.engine_inflight = "not a map"
    outcomes = await InProcessFleetClient(VllmCore(core)).call_utility(
        "has_work", timeout_s=TIMEOUT
    )
    assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, True)] * 3


@pytest.mark.parametrize("absent", ["missing", "None"])
async def test_a_front_end_without_an_own_count_leaves_vllms_answer(absent: str) -> None:
    """vLLM's clients other than the internal load balancer's (DP 1, external load
    balancing) keep no such count: ``has_work`` is vLLM's answer alone."""
    core = StubCore()
    if absent == "missing":
        del core.engine_inflight
    else:
        core.engine_inflight = None
    client = InProcessFleetClient(VllmCore(core))
    outcomes = await client.call_utility("has_work", timeout_s=TIMEOUT)
    assert [(o.outcome, o.value) for o in outcomes] == [(Outcome.OK, False)] * 3
    assert VllmCore(core).request_counts([0, 1, 2]) == {r: RequestCounts(0, 0) for r in range(3)}


class Watched(list[Any]):
    """A table that records which positions were read."""

    def __init__(self, items: list[Any]) -> None:
        super().__init__(items)
        self.read: list[int] = []

    def __getitem__(self, index: Any) -> Any:
        self.read.append(index)
        return super().__getitem__(index)


class WatchedCounter(Counter[bytes]):
    def __init__(self, counts: dict[bytes, int]) -> None:
        super().__init__(counts)
        self.asked: list[bytes] = []

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.append(key)
        return super().get(key, default)


def test_the_counts_of_some_ranks_read_only_their_entries() -> None:
    """A paced poll's burst asks for its own ranks: only their entries of vLLM's tables are
    read (positions found once per list of engines, not every entry walked each time), in
    whatever order vLLM lists its engines."""
    core = StubCore()
    core.core_engines = [IDS[2], IDS[0], IDS[1]]
    core.engine_ranks_managed = [2, 0, 1]
    core.lb_engines = Watched([[1, 5, 0.0], [0, 0, 0.0], [0, 3, 0.0]])
    core.engine_inflight = WatchedCounter({IDS[1]: 4, IDS[2]: 1})
    vllm = VllmCore(core)
    assert vllm.request_counts([1]) == {1: RequestCounts(4, 0)}  # raised to its own 4
    assert core.lb_engines.read == [2] and core.engine_inflight.asked == [IDS[1]]
    assert vllm.request_counts([2, 0]) == {2: RequestCounts(5, 1), 0: RequestCounts(0, 0)}
    assert core.lb_engines.read == [2, 0, 1]
    assert vllm.own_unfinished([0]) == {0: 0}
    # vLLM's engines change (elastic EP): the positions are found again.
    core.core_engines = [IDS[0], IDS[1]]
    core.engine_inflight = [7, 0]
    assert vllm.own_unfinished([0, 2]) == {0: 7}
