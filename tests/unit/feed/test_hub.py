"""The feed's hub over plain snapshots: changes, ids, resume, the bounded queue and the limit."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from exporter.client.fleet import EngineDetail
from exporter.feed.hub import EXPIRED, PARTIAL, RESTARTED, UNKNOWN_ID, WatchHub, stream
from exporter.fleetstate.snapshot import FleetSnapshot
from exporter.protocol.activity import RequestCounts
from tests.harness.snapshots import engine_snapshot, polled
from tests.harness.sse import Event, parse_events

AWAKE: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False, "has_work": False}


def fleet(*running: int, paused: frozenset[int] = frozenset()) -> FleetSnapshot:
    engines = [
        engine_snapshot(
            str(i),
            EngineDetail(str(i), True, "x", requests=RequestCounts(n, 0)),
            **{**AWAKE, "is_scheduler_paused": i in paused},
        )
        for i, n in enumerate(running)
    ]
    return polled(*engines)


class Source:
    def __init__(self, snap: FleetSnapshot) -> None:
        self.snap = snap

    def __call__(self) -> FleetSnapshot:
        return self.snap


def make_hub(snap: FleetSnapshot, **kwargs: object) -> tuple[WatchHub, Source]:
    source = Source(snap)
    hub = WatchHub(source, max_watchers=kwargs.pop("max_watchers", 4), epoch="abcd", **kwargs)  # type: ignore[arg-type]
    return hub, source


def events(frames: list[bytes]) -> list[Event]:
    return parse_events(b"".join(frames).decode())


def publish(hub: WatchHub, source: Source, snap: FleetSnapshot) -> None:
    source.snap = snap
    hub.publish(snap)


def test_nothing_is_built_before_the_first_watcher() -> None:
    hub, source = make_hub(fleet(0, 0))
    publish(hub, source, fleet(1, 0))
    assert not hub.active and hub.seq == 0 and hub.counts.events == 0


def test_a_watcher_gets_a_snapshot_then_each_change_once() -> None:
    hub, source = make_hub(fleet(0, 0, 0))
    watcher = hub.connect(None)
    assert watcher is not None
    first = events(list(watcher.frames))
    watcher.frames.clear()
    assert [e.event for e in first] == ["snapshot", "rank", "rank", "rank"]
    assert first[0].data["reason"] == "connect" and first[0].data["engines"] == ["0", "1", "2"]
    assert [e.id for e in first] == ["abcd-0.0", "abcd-0.1", "abcd-0.2", "abcd-0"]
    publish(hub, source, fleet(0, 0, 0))  # no change: no event
    assert not watcher.frames
    publish(hub, source, fleet(0, 0, 0, paused=frozenset({1})))
    publish(hub, source, fleet(0, 0, 2, paused=frozenset({1})))
    changes = events(list(watcher.frames))
    assert [(e.id, e.data["engine"]) for e in changes] == [("abcd-1", "1"), ("abcd-2", "2")]
    assert changes[0].data["routable"] is False and changes[0].data["reasons"] == ["paused"]
    assert changes[1].data["running"] == 2
    assert hub.counts.events == 2


def test_a_rank_that_leaves_is_sent_gone() -> None:
    hub, source = make_hub(fleet(0, 0, 0))
    watcher = hub.connect(None)
    assert watcher is not None
    watcher.frames.clear()
    publish(hub, source, fleet(0, 0))
    (gone,) = events(list(watcher.frames))
    assert gone.data["engine"] == "2" and gone.data["state"] == "gone"


def test_a_resume_gets_every_change_after_its_id_and_no_snapshot() -> None:
    hub, source = make_hub(fleet(0, 0, 0))
    assert hub.connect(None) is not None
    for n in range(1, 4):
        publish(hub, source, fleet(n, 0, 0))
    resumed = hub.connect("abcd-1")
    assert resumed is not None and resumed.start == "resume"
    got = events(list(resumed.frames))
    assert [e.id for e in got] == ["abcd-2", "abcd-3"]
    assert [e.data["running"] for e in got] == [2, 3]
    caught_up = hub.connect("abcd-3")
    assert caught_up is not None and not caught_up.frames and caught_up.start == "resume"


def test_ids_that_cannot_resume_get_a_fresh_snapshot_saying_why() -> None:
    hub, source = make_hub(fleet(0, 0), history_limit=2, max_watchers=10)
    assert hub.connect(None) is not None
    for n in range(1, 6):
        publish(hub, source, fleet(n, 0))
    cases = {
        "abcd-1": EXPIRED,  # older than the history kept
        "ffff-3": RESTARTED,  # another run of the exporter
        "abcd-99": UNKNOWN_ID,  # a change this run never published
        "abcd-4.1": PARTIAL,  # left inside a snapshot
        "garbage" * 100: UNKNOWN_ID,
    }
    for last_id, reason in cases.items():
        watcher = hub.connect(last_id)
        assert watcher is not None
        head = events(list(watcher.frames))[0]
        assert (head.event, head.data["reason"]) == ("snapshot", reason), last_id
        assert events(list(watcher.frames))[-1].id == "abcd-5"


def test_beyond_max_watchers_is_refused_and_counted() -> None:
    hub, _ = make_hub(fleet(0), max_watchers=2)
    assert hub.connect(None) is not None and hub.connect(None) is not None
    assert hub.connect(None) is None and hub.counts.refused == 1
    gone = next(iter(hub.watchers))
    hub.disconnect(gone)
    assert hub.connect(None) is not None


def test_a_watcher_a_whole_queue_behind_is_dropped_not_waited_for() -> None:
    hub, source = make_hub(fleet(0))
    closed: list[bool] = []
    slow = hub.connect(None)
    fast = hub.connect(None)
    assert slow is not None and fast is not None
    slow.on_drop = lambda: closed.append(True)
    for n in range(1, slow.limit + 5):
        publish(hub, source, fleet(n))
        fast.frames.clear()  # this one keeps up
    assert slow.dropped and not slow.frames and closed == [True]
    assert slow not in hub.watchers and fast in hub.watchers
    assert hub.counts.dropped == 1


async def test_the_stream_writes_what_is_queued_at_once_and_heartbeats_when_idle() -> None:
    hub, source = make_hub(fleet(0, 0), heartbeat_s=0.05)
    watcher = hub.connect(None)
    assert watcher is not None
    chunks = stream(hub, watcher)
    first = await asyncio.wait_for(chunks.__anext__(), 5)
    assert [e.event for e in parse_events(first.decode())] == ["snapshot", "rank", "rank"]
    beat = await asyncio.wait_for(chunks.__anext__(), 5)
    (event,) = parse_events(beat.decode())
    assert (event.event, event.id) == ("heartbeat", "abcd-0")
    publish(hub, source, fleet(3, 0))
    change = await asyncio.wait_for(chunks.__anext__(), 5)
    assert json.loads(change.split(b"data: ")[1])["running"] == 3
    hub.close()
    assert watcher.ended
    await asyncio.wait_for(chunks.aclose(), 5)
