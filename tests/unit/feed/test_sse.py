"""The feed's ids and ``Last-Event-ID`` (pure): bounded work on any input."""

from __future__ import annotations

import pytest

from exporter.feed.sse import LastEventId, event_id, frame, parse_last_event_id


def test_ids_name_the_run_the_change_and_a_part_of_a_snapshot() -> None:
    assert event_id("ab12", 7) == "ab12-7"
    assert event_id("ab12", 7, 0) == "ab12-7.0"
    assert parse_last_event_id("ab12-7") == LastEventId("ab12", 7, False)
    assert parse_last_event_id("ab12-7.3") == LastEventId("ab12", 7, True)


def test_a_frame_is_one_sse_event() -> None:
    assert frame("rank", "e-1", b'{"a":1}') == b'event: rank\nid: e-1\ndata: {"a":1}\n\n'


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "-",
        "ab12",
        "ab12-",
        "-7",
        "AB12-7",  # the epoch is lower-case hex
        "zz-7",
        "ab12-7.",
        "ab12-7.x",
        "ab12-²",  # str.isdigit takes it, int() does not
        "ab12-\u0661",  # int() reads it as 1
        "ab12--7",
        "ab12-7\n",
        "a" * 49 + "-1",  # past MAX_EVENT_ID: refused before any parse
        "ab12-" + "9" * 10_000,
    ],
)
def test_anything_else_is_not_an_id(text: str | None) -> None:
    assert parse_last_event_id(text) is None
