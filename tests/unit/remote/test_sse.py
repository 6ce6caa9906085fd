"""The event-stream reader, on the feed's own frames and on hostile input: every line ending,
events split anywhere across chunks, comments and unknown fields ignored, and memory bounded
(a line or an event past its bound is an ``InvalidAnswer`` as soon as it is seen, whatever the
chunking)."""

from __future__ import annotations

import pytest

from exporter.remote.errorbase import InvalidAnswer
from exporter.remote.sse import MAX_EVENT_BYTES, MAX_LINE_BYTES, SseEvent, SseParser

FRAMES = (
    b'event: snapshot\nid: ab12-3.0\ndata: {"reason":"connect"}\n\n'
    b'event: rank\nid: ab12-3.1\ndata: {"engine":"0"}\n\n'
    b'event: rank\nid: ab12-3\ndata: {"engine":"1"}\n\n'
)
EXPECTED = [
    SseEvent("snapshot", "ab12-3.0", '{"reason":"connect"}'),
    SseEvent("rank", "ab12-3.1", '{"engine":"0"}'),
    SseEvent("rank", "ab12-3", '{"engine":"1"}'),
]


def feed_all(chunks: list[bytes], parser: SseParser | None = None) -> list[SseEvent]:
    parser = parser or SseParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_many_events_in_one_chunk() -> None:
    assert feed_all([FRAMES]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
def test_the_same_events_whatever_the_chunking(size: int) -> None:
    chunks = [FRAMES[i : i + size] for i in range(0, len(FRAMES), size)]
    assert feed_all(chunks) == EXPECTED


def test_an_event_split_over_chunks_comes_when_its_blank_line_does() -> None:
    parser = SseParser()
    assert parser.feed(b"event: rank\nid: a-1\nda") == []
    assert parser.feed(b'ta: {"engine":"0"}\n') == []
    assert parser.feed(b"\n") == [SseEvent("rank", "a-1", '{"engine":"0"}')]


@pytest.mark.parametrize("eol", [b"\r\n", b"\r", b"\n"], ids=["crlf", "cr", "lf"])
def test_every_line_ending(eol: bytes) -> None:
    text = FRAMES.replace(b"\n", eol)
    assert feed_all([text]) == EXPECTED
    assert feed_all([text[i : i + 1] for i in range(len(text))]) == EXPECTED


def test_a_crlf_split_between_chunks_is_one_line_end() -> None:
    parser = SseParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"\ndata: b\r") == []  # the LF ends nothing more: no blank line
    assert parser.feed(b"\n") == []  # completes the CRLF after b: still no blank line
    assert parser.feed(b"\r") == [SseEvent("message", "", "a\nb")]  # the blank line
    assert parser.feed(b"\n") == []  # its LF: not a second blank line
    assert parser.feed(b"data: c\n\n") == [SseEvent("message", "", "c")]


def test_comments_unknown_fields_and_retry_are_ignored() -> None:
    text = (
        b": keep-alive\n"
        b":\n"
        b"retry: 10\n"
        b"colour: blue\n"
        b"Data: not the data field (names are case-sensitive)\n"
        b"data\n"  # a field without a colon: an empty value
        b"data:x\n"  # no space after the colon
        b"data:  two spaces keep one\n"
        b"\n"
    )
    assert feed_all([text]) == [SseEvent("message", "", "\nx\n two spaces keep one")]


def test_a_block_without_data_dispatches_nothing_but_its_id_lasts() -> None:
    parser = SseParser()
    assert parser.feed(b"event: rank\nid: a-7\n\n") == []
    assert parser.last_event_id == "a-7"
    assert parser.feed(b"data: {}\n\n") == [SseEvent("message", "a-7", "{}")]  # type reset


def test_an_id_with_a_nul_is_ignored_and_an_empty_id_clears_it() -> None:
    parser = SseParser(last_event_id="a-1")
    assert parser.feed(b"id: a-\x002\ndata: x\n\n") == [SseEvent("message", "a-1", "x")]
    assert parser.feed(b"id\ndata: y\n\n") == [SseEvent("message", "", "y")]


def test_a_bom_at_the_start_is_dropped_and_bad_utf8_replaced() -> None:
    events = feed_all([b"\xef\xbb", b"\xbfdata: caf\xc3\xa9 \xff\n\n"])
    assert events == [SseEvent("message", "", "caf\u00e9 \ufffd")]


def test_an_event_cut_off_by_the_end_of_the_stream_is_never_dispatched() -> None:
    assert feed_all([b"event: rank\ndata: {}\n"]) == []
    assert feed_all([b"data: {}"]) == []  # no newline at all


def test_a_line_past_the_bound_is_refused_without_a_newline_ever_coming() -> None:
    parser = SseParser(max_line_bytes=100)
    parser.feed(b"data: " + b"x" * 94)  # exactly 100 bytes: still fine
    with pytest.raises(InvalidAnswer, match="line longer than 100 bytes"):
        parser.feed(b"x")


def test_a_huge_line_in_small_chunks_is_refused_at_the_bound() -> None:
    parser = SseParser()
    chunk = b"y" * 65536
    fed = 0
    with pytest.raises(InvalidAnswer, match="line longer than"):
        while True:
            parser.feed(chunk)
            fed += len(chunk)
            assert fed <= MAX_LINE_BYTES, "a line past the bound was taken"
    assert MAX_LINE_BYTES - len(chunk) < fed <= MAX_LINE_BYTES


def test_a_comment_line_is_bounded_too() -> None:
    parser = SseParser(max_line_bytes=10)
    with pytest.raises(InvalidAnswer):
        parser.feed(b":" + b"z" * 20)


def test_an_event_of_many_short_lines_is_refused_at_the_bound() -> None:
    parser = SseParser(max_event_bytes=1000)
    parser.feed(b"data: 123456789\n" * 62)  # 62 lines of 16 bytes: 992
    with pytest.raises(InvalidAnswer, match="event larger than 1000 bytes"):
        parser.feed(b"data: 123456789\n")
    assert MAX_EVENT_BYTES == 2**20


def test_the_event_bound_is_per_event() -> None:
    parser = SseParser(max_event_bytes=100)
    one = b"data: " + b"e" * 60 + b"\n\n"
    assert len(feed_all([one * 50], parser)) == 50


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SseParser(max_line_bytes=0)
    with pytest.raises(ValueError):
        SseParser(max_event_bytes=0)
