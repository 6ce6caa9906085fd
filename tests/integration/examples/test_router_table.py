"""The example router's table and choice without sockets: the feed's events parsed, a fresh
snapshot replacing the table only once complete, a rank gone, the labels turned into
``X-data-parallel-rank`` values, and the choice (routable only, vLLM's score, round robin)."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from unittest import mock

import pytest
from aiohttp import StreamReader

from examples.router.router import (
    MAX_RANKS,
    Router,
    RouterConfig,
    SseEvent,
    header_rank,
    sse_events,
)


def router(first_rank: int = 0) -> Router:
    return Router(RouterConfig("http://vllm", "http://exporter/watch", first_rank=first_rank))


def row(engine: str, routable: bool = True, **fields: Any) -> SseEvent:
    return SseEvent("rank", None, json.dumps({"engine": engine, "routable": routable, **fields}))


def snapshot(*engines: str) -> SseEvent:
    return SseEvent("snapshot", "ab-1.0", json.dumps({"engines": list(engines)}))


async def test_events_are_parsed_as_server_sent_events() -> None:
    reader = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    reader.feed_data(
        b": a comment\nevent: snapshot\nid: ab-3.0\ndata: {}\n\n"
        b'event: rank\r\nid: ab-3\r\ndata:{"a":\r\ndata: 1}\r\n\r\n'
        b"event: heartbeat\nid: ab-3\n\n"  # no data: no event
        b"data: x\n\nevent: rank\ndata: unfinished"
    )
    reader.feed_eof()
    events = [e async for e in sse_events(reader)]
    assert events == [
        SseEvent("snapshot", "ab-3.0", "{}"),
        SseEvent("rank", "ab-3", '{"a":\n1}'),
        SseEvent("message", None, "x"),
    ]


@pytest.mark.parametrize(
    ("label", "first", "header"),
    [
        *[("0", 0, 0), ("3", 0, 3), ("api-0/1", 0, 1), ("5", 4, 1), ("3", 4, None)],
        *[("api-0", 0, None), ("", 0, None), ("-1", 0, None), ("\u0661", 0, None)],
    ],
)
def test_labels_become_header_values(label: str, first: int, header: int | None) -> None:
    assert header_rank(label, first) == header


def test_a_snapshot_replaces_the_table_once_every_rank_came() -> None:
    r = router()
    for event in (snapshot("0", "1"), row("0"), row("1")):
        r._apply(event)
    assert r.routable() == ["0", "1"] and r.last_event_id == "ab-1.0"
    r._apply(snapshot("0", "1", "2"))
    r._apply(row("0", routable=False))
    assert r.routable() == ["0", "1"], "the old table serves until the new one is complete"
    r._apply(row("2"))
    r._apply(row("1"))
    assert r.routable() == ["1", "2"] and r.engines == ["0", "1", "2"]
    r._apply(row("1", routable=False))
    r._apply(SseEvent("rank", None, json.dumps({"engine": "2", "state": "gone"})))
    assert r.routable() == [] and r.engines == ["0", "1"]
    r._apply(row("7"))  # a rank the snapshot did not list: added
    r._apply(SseEvent("rank", None, "not json"))
    r._apply(SseEvent("rank", None, "[1]"))
    r._apply(SseEvent("heartbeat", "ab-9", "{}"))
    assert r.routable() == ["7"] and r.last_event_id == "ab-9" and r.fresh()


def test_the_table_is_bounded() -> None:
    r = router()
    for k in range(MAX_RANKS + 10):
        r._apply(row(str(k)))
    assert len(r.rows) == MAX_RANKS == len(r.engines)


def test_the_choice_is_the_lowest_score_round_robin_on_ties() -> None:
    r = router()
    for event in (snapshot("0", "1", "2"), row("0"), row("1", routable=False), row("2")):
        r._apply(event)
    assert [r.pick() for _ in range(4)] == ["0", "2", "0", "2"]
    r._apply(row("0", running=3, waiting=1))
    assert [r.pick() for _ in range(2)] == ["2", "2"]
    r.inflight["2"] = 5  # a burst of this router's own: max(5, 0) > max(0, 4)
    assert r.pick() == "0"
    r._apply(row("0", routable=False))
    r._apply(row("2", routable=False))
    assert r.pick() is None


def test_the_first_rank_shifts_the_header_and_hides_other_ranks() -> None:
    r = router(first_rank=2)
    for event in (snapshot("1", "2", "3"), row("1"), row("2"), row("3")):
        r._apply(event)
    assert r.routable() == ["2", "3"]
    assert [header_rank(e, 2) for e in r.routable()] == [0, 1]
