"""A small Server-Sent Events reader for the feed's tests: real HTTP, bounded waits."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import aiohttp

#: The longest a test waits for one event.
EVENT_WAIT_S = 10.0


@dataclass(frozen=True)
class Event:
    event: str
    id: str
    data: Any


def parse_events(text: str) -> list[Event]:
    """Every complete event in ``text`` (blocks separated by a blank line)."""
    events = []
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            name, sep, value = line.partition(": ")
            if sep and not line.startswith(":"):
                fields[name] = value
        if "data" in fields:
            events.append(
                Event(
                    fields.get("event", "message"), fields.get("id", ""), json.loads(fields["data"])
                )
            )
    return events


class EventReader:
    """Reads the events of one open ``/watch`` response."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self._buffer = ""

    async def next(self, timeout_s: float = EVENT_WAIT_S) -> Event:
        async def read_one() -> Event:
            while "\n\n" not in self._buffer:
                chunk = await self.response.content.readany()
                if not chunk:
                    raise EOFError("the feed ended")
                self._buffer += chunk.decode()
            block, self._buffer = self._buffer.split("\n\n", 1)
            found = parse_events(block + "\n\n")
            assert found, f"not an event: {block!r}"
            return found[0]

        return await asyncio.wait_for(read_one(), timeout_s)

    async def next_of(self, kind: str, timeout_s: float = EVENT_WAIT_S) -> Event:
        """The next event named ``kind`` (others are skipped)."""

        async def find() -> Event:
            while True:
                event = await self.next(timeout_s)
                if event.event == kind:
                    return event

        return await asyncio.wait_for(find(), timeout_s)

    async def until(self, predicate: Any, timeout_s: float = EVENT_WAIT_S) -> Event:
        """The first event for which ``predicate(event)`` holds."""

        async def find() -> Event:
            while True:
                event = await self.next(timeout_s)
                if predicate(event):
                    return event

        return await asyncio.wait_for(find(), timeout_s)
