"""The ``/watch`` feed's wire (pure): Server-Sent Events, their ids, and ``Last-Event-ID``.

Every event has an ``id:`` of the form ``EPOCH-SEQ``: ``EPOCH`` names this exporter's run (a
restarted exporter has another), ``SEQ`` counts the changes it published. The events of a fresh
snapshot carry ``EPOCH-SEQ.K`` (K = 0, 1, ...) and the last of them the plain ``EPOCH-SEQ``: a
client that lost the connection inside a snapshot resumes with an id holding a dot and gets a
fresh snapshot; one that resumes with a plain id gets every change after it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: The media type of the feed.
EVENT_STREAM = "text/event-stream"
#: The longest ``Last-Event-ID`` read; a longer one is a fresh snapshot, never parsed.
MAX_EVENT_ID = 48
#: The event names (``event:``).
RANK, SNAPSHOT, HEARTBEAT = "rank", "snapshot", "heartbeat"


def event_id(epoch: str, seq: int, part: int | None = None) -> str:
    """``EPOCH-SEQ``, or ``EPOCH-SEQ.PART`` inside a snapshot."""
    return f"{epoch}-{seq}" if part is None else f"{epoch}-{seq}.{part}"


def frame(event: str, ident: str, data: bytes) -> bytes:
    """One event as SSE writes it (``data`` is one line of JSON: no newline to split)."""
    return b"event: %s\nid: %s\ndata: %s\n\n" % (event.encode(), ident.encode(), data)


def json_data(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class LastEventId:
    """A client's ``Last-Event-ID`` as read: its run, the last change it has, and whether it
    stopped inside a snapshot (then it needs a fresh one)."""

    epoch: str
    seq: int
    partial: bool


def _digits(text: str) -> bool:
    return bool(text) and text.isascii() and text.isdigit()


def parse_last_event_id(text: str | None) -> LastEventId | None:
    """``text`` as an id this feed sends, or None for anything else (absent, empty, too long,
    not ``EPOCH-SEQ[.K]`` with a hex epoch and ASCII digits): bounded work on any input."""
    if not text or len(text) > MAX_EVENT_ID:
        return None
    epoch, sep, rest = text.partition("-")
    if not sep or not epoch or not all(c in "0123456789abcdef" for c in epoch):
        return None
    seq, dot, part = rest.partition(".")
    if not _digits(seq) or (dot and not _digits(part)):
        return None
    return LastEventId(epoch, int(seq), bool(dot))
