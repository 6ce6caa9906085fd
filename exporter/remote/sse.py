"""Server-Sent Events read from bytes as they arrive (pure: no I/O), with bounded memory.

The reader of ``GET /watch`` (``exporter.remote.watching``). It follows the WHATWG event-stream
rules: lines end in CRLF, LF or CR (a CR at the end of one chunk and an LF at the start of the
next are one line end); a line starting with ``:`` is a comment; ``data:`` lines are joined
with ``"\\n"``; a blank line dispatches the event (none when it had no ``data:``); an ``id:``
holding a NUL is ignored; ``retry:`` and unknown fields are ignored (the client's own backoff
decides when to reconnect); an event cut off by the end of the stream is never dispatched.

Whatever sends the stream is not trusted: a line longer than ``max_line_bytes`` or an event
whose data is larger than ``max_event_bytes`` is an ``InvalidAnswer`` as soon as it is seen, so
a peer that never sends a newline cannot make the client buffer without end.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from exporter.remote.errorbase import InvalidAnswer

#: The longest line, and the largest event, read (a rank's row is about 0.5 KB).
MAX_LINE_BYTES = 2**20
MAX_EVENT_BYTES = 2**20
#: The event type of an event without ``event:``.
DEFAULT_EVENT = "message"
_EOL = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One dispatched event: its type, the last event id in effect, its data lines joined."""

    event: str
    id: str
    data: str


class SseParser:
    """Feed it the stream's chunks in order (``feed``); it returns the events each completes.

    ``last_event_id`` is the id a reconnecting client sends back (``Last-Event-ID``): it lasts
    from one event to the next, as in a browser's ``EventSource``, and may be given to start
    with (a resumed stream keeps the id it resumed from until the server sends another)."""

    def __init__(
        self,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
        last_event_id: str = "",
    ) -> None:
        if max_line_bytes < 1 or max_event_bytes < 1:
            raise ValueError("the line and event bounds must be positive")
        self.max_line_bytes = max_line_bytes
        self.max_event_bytes = max_event_bytes
        self.last_event_id = last_event_id
        self._line = bytearray()
        self._after_cr = False
        self._first_line = True
        self._event = ""
        self._data: list[str] = []
        self._size = 0

    def feed(self, chunk: bytes) -> list[SseEvent]:
        """The events ``chunk`` completes (in order); ``InvalidAnswer`` past a bound."""
        events: list[SseEvent] = []
        start = 1 if self._after_cr and chunk[:1] == b"\n" else 0
        self._after_cr = False
        end = len(chunk)
        while start < end:
            found = _EOL.search(chunk, start)
            if found is None:
                self._keep(chunk, start, end)
                break
            self._keep(chunk, start, found.start())
            # A lone CR last in the chunk: an LF first in the next one ends nothing more.
            self._after_cr = found.group() == b"\r" and found.end() == end
            line = bytes(self._line)
            self._line.clear()
            self._take(line, events)
            start = found.end()
        return events

    def _keep(self, chunk: bytes, start: int, end: int) -> None:
        """Add ``chunk[start:end]`` to the line being read, refusing one past the bound."""
        if len(self._line) + end - start > self.max_line_bytes:
            raise InvalidAnswer(
                f"the event stream sent a line longer than {self.max_line_bytes} bytes"
            )
        self._line += chunk[start:end]

    def _take(self, raw: bytes, events: list[SseEvent]) -> None:
        """One whole line: a field, a comment, or the blank line that dispatches."""
        if self._first_line:
            self._first_line = False
            raw = raw.removeprefix(_BOM)
        if not raw:
            self._dispatch(events)
            return
        if raw.startswith(b":"):
            return  # a comment (a keep-alive)
        name, colon, value = raw.decode("utf-8", "replace").partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._size += len(raw) + 1  # the line as sent: a bound in bytes
            if self._size > self.max_event_bytes:
                raise InvalidAnswer(
                    f"the event stream sent an event larger than {self.max_event_bytes} bytes"
                )
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self.last_event_id = value

    def _dispatch(self, events: list[SseEvent]) -> None:
        if self._data:
            events.append(
                SseEvent(self._event or DEFAULT_EVENT, self.last_event_id, "\n".join(self._data))
            )
        self._event = ""
        self._data = []
        self._size = 0
