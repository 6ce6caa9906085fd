"""Where ``/watch`` takes the id a client resumes from, and its answer beyond the limit."""

from __future__ import annotations

import json

from exporter.feed.hub import WatchHub
from exporter.web.watch import last_event_id, refused
from tests.harness.snapshots import engine_snapshot, polled


def test_the_header_wins_over_the_query() -> None:
    assert last_event_id({"Last-Event-ID": "a-1"}, {"last_event_id": ["b-2"]}) == "a-1"
    assert last_event_id({}, {"last_event_id": ["b-2"]}) == "b-2"
    assert last_event_id({}, {"last_event_id": ["b-2", "c-3"]}) is None  # ambiguous: ignored
    assert last_event_id({}, {}) is None


def test_beyond_the_limit_a_503_names_the_setting() -> None:
    hub = WatchHub(lambda: polled(engine_snapshot("0")), max_watchers=3)
    answer = refused(hub)
    assert answer.status == 503 and answer.headers["Retry-After"] == "5"
    assert "at most 3 watchers" in json.loads(answer.body)["error"]
