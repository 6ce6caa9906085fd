"""The ``/watch`` feed in every attach mode (``fake``, ``owner``, ``relay``, ``http``,
``http_plugin``, ``inprocess``), through the exporter's own HTTP surface over each kind's real
client: the snapshot names every rank; a rank frozen at the first, middle or last position is
sent hung and not routable while its neighbours send nothing of the kind; thawed, it is sent
routable again; where the mode counts requests, a rank given work is sent with its counts."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.fleet_kinds import ENGINES, FleetKind, ServedKind, serve_kind
from tests.harness.sse import EventReader

pytestmark = pytest.mark.timeout(90)

HUNG_AFTER_S = 1.0
POSITIONS = {"first": 0, "middle": 1, "last": 2}
WAIT_S = 15.0
LONG_S = 600.0


@pytest.fixture
async def served(fleet_kind: FleetKind) -> AsyncIterator[ServedKind]:
    served = await serve_kind(fleet_kind, call_timeout=0.5, hung_after=HUNG_AFTER_S)
    yield served
    await served.close()


async def snapshot(reader: EventReader) -> list[dict[str, object]]:
    head = await reader.next(WAIT_S)
    assert head.event == "snapshot" and len(head.data["engines"]) == ENGINES
    return [(await reader.next(WAIT_S)).data for _ in range(ENGINES)]


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_frozen_rank_is_sent_hung_then_routable(served: ServedKind, position: int) -> None:
    kind = served.kind
    label = kind.labels[position]
    await served.fresh_poll()
    async with served.session.get(served.url + "/watch") as resp:
        reader = EventReader(resp)
        rows = await snapshot(reader)
        assert [r["engine"] for r in rows] == kind.labels
        await kind.freeze(position)  # as SIGSTOP leaves an engine
        hung = await reader.until(
            lambda e: e.data.get("engine") == label and bool(e.data["hung"]), WAIT_S
        )
        assert hung.event == "rank" and hung.data["routable"] is False
        await kind.thaw(position)
        back = await reader.until(
            lambda e: e.data.get("engine") == label and bool(e.data["routable"]), WAIT_S
        )
        assert back.data["state"] == "awake"


async def test_work_is_sent_with_its_counts_where_the_mode_counts(served: ServedKind) -> None:
    kind = served.kind
    if not kind.client.capabilities.request_counts:
        pytest.skip(f"{kind.name} mode does not count requests (docs/activity.md)")
    await served.fresh_poll()
    async with served.session.get(served.url + "/watch") as resp:
        reader = EventReader(resp)
        await snapshot(reader)
        label = kind.labels[1]
        await kind.give_work(1, LONG_S, count=2)
        busy = await reader.until(
            lambda e: e.data.get("engine") == label and (e.data.get("running") or 0) >= 1,
            WAIT_S,
        )
        assert busy.data["has_work"] in (True, None)
        await kind.finish_work(1)
        await reader.until(
            lambda e: e.data.get("engine") == label and e.data.get("running") == 0, WAIT_S
        )
