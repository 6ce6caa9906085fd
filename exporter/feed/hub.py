"""The ``/watch`` feed's hub: every rank's last row, the changes since, and who reads them.

The poller hands the hub each snapshot it publishes (a poll, or a push republished at once);
the hub compares every rank's row with the last one (``RankRow.key``) and turns each change into
one event, encoded once and queued for every watcher (one append each: a watcher's writer
writes it). A watcher whose queue is full is dropped and counted, never waited for; at most
``max_watchers`` are connected at once. The last ``history_limit`` changes are kept so a
client that reconnects with ``Last-Event-ID`` gets what it missed; anything older gets a fresh
snapshot, said in its first event.

The hub costs nothing until the first watcher connects (no row is built before).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field

from exporter.feed.rows import RankRow, gone_row, progress_ages, rank_rows
from exporter.feed.sse import (
    HEARTBEAT,
    RANK,
    SNAPSHOT,
    event_id,
    frame,
    json_data,
    parse_last_event_id,
)
from exporter.fleetstate.snapshot import FleetSnapshot

#: Changes kept for ``Last-Event-ID`` (about 0.5 KB each).
HISTORY_LIMIT = 4096
#: A watcher's queue holds at least this many events, and always two full snapshots' worth.
QUEUE_MIN = 256
#: A heartbeat at least this often while nothing changes.
HEARTBEAT_S = 5.0
#: Why a connection starts with a fresh snapshot (the ``reason`` of its ``snapshot`` event).
CONNECT, RESTARTED, EXPIRED, UNKNOWN_ID, PARTIAL = (
    "connect",
    "restarted",
    "expired",
    "unknown_id",
    "partial",
)


@dataclass(eq=False)
class Watcher:
    """One connected reader: the frames queued for it, and whether the hub dropped it."""

    limit: int
    frames: deque[bytes] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    #: The last change queued for it (the id its heartbeats carry).
    last_seq: int = 0
    dropped: bool = False
    closed: bool = False
    #: Called once when the hub drops it (the server closes the connection).
    on_drop: Callable[[], None] | None = None
    #: How it started: a fresh snapshot (and why) or a resume.
    start: str = CONNECT

    def put(self, data: bytes, seq: int) -> bool:
        """Queue ``data``; False when the queue is full (the hub then drops this watcher)."""
        if len(self.frames) >= self.limit:
            return False
        self.frames.append(data)
        self.last_seq = seq
        self.wake.set()
        return True

    async def take(self, timeout_s: float) -> list[bytes]:
        """Every frame queued, waiting up to ``timeout_s`` for one (empty: none came, or the
        watcher was dropped or closed)."""
        if not self.frames and not (self.dropped or self.closed):
            self.wake.clear()
            # Not ``wait_for``: before Python 3.12 it can swallow a cancellation.
            waiter = asyncio.ensure_future(self.wake.wait())
            try:
                await asyncio.wait((waiter,), timeout=timeout_s)
            finally:
                waiter.cancel()
        taken = list(self.frames)
        self.frames.clear()
        return taken

    @property
    def ended(self) -> bool:
        return self.dropped or self.closed


@dataclass
class WatchCounts:
    """The feed's counters (``vllm_dp_watch_*``)."""

    dropped: int = 0
    refused: int = 0
    events: int = 0

    def version(self, watchers: int) -> tuple[int, ...]:
        """What a render cache keys on (``Exporter.state_version``)."""
        return (self.dropped, self.refused, self.events, watchers)


def _changed(old: RankRow | None, new: RankRow) -> bool:
    return old is None or old.key != new.key


class WatchHub:
    """Rows, changes and watchers of one exporter (see the module's docstring)."""

    def __init__(
        self,
        snapshot: Callable[[], FleetSnapshot],
        *,
        max_watchers: int,
        history_limit: int = HISTORY_LIMIT,
        heartbeat_s: float = HEARTBEAT_S,
        wall_clock: Callable[[], float] = time.time,
        epoch: str | None = None,
    ) -> None:
        self._snapshot = snapshot
        self.max_watchers = max_watchers
        self.heartbeat_s = heartbeat_s
        self._wall = wall_clock
        #: This run's name in every id.
        self.epoch = epoch or secrets.token_hex(4)
        self.seq = 0
        self.counts = WatchCounts()
        self.watchers: set[Watcher] = set()
        self._history: deque[tuple[int, bytes]] = deque(maxlen=history_limit)
        self._rows: dict[str, RankRow] = {}
        self._poll = 0
        self._ages: dict[str, float | None] = {}
        self.active = False

    def queue_limit(self) -> int:
        return max(QUEUE_MIN, 2 * len(self._rows) + 2)

    def publish(self, snap: FleetSnapshot) -> None:
        """Turn every rank whose row changed in ``snap`` into one event for every watcher."""
        if not self.active:
            return
        old = self._take(snap)
        rows = self._rows
        changed = [row for engine, row in rows.items() if _changed(old.get(engine), row)]
        changed += [gone_row(engine) for engine in old if engine not in rows]
        for row in changed:
            self._emit(row)

    def _take(self, snap: FleetSnapshot) -> dict[str, RankRow]:
        """Keep ``snap``'s rows (and what moves with the clock); returns the rows it replaced."""
        old = self._rows
        self._rows = rank_rows(snap)
        self._poll, self._ages = snap.poll_number, progress_ages(snap)
        return old

    def _emit(self, row: RankRow) -> None:
        self.seq += 1
        seq = self.seq
        data = frame(RANK, event_id(self.epoch, seq), self._row_data(row))
        self._history.append((seq, data))
        self.counts.events += 1
        for watcher in list(self.watchers):
            if not watcher.put(data, seq):
                self.drop(watcher)

    def _row_data(self, row: RankRow) -> bytes:
        return row.data(self._poll, self._wall(), self._ages.get(row.engine))

    def connect(self, last_event_id: str | None) -> Watcher | None:
        """A new watcher with its first frames queued (a resume, or a fresh snapshot), or None
        when ``max_watchers`` are connected already (counted)."""
        if len(self.watchers) >= self.max_watchers:
            self.counts.refused += 1
            return None
        if not self.active:
            self.active = True
            self._take(self._snapshot())  # the rows now; no event: nobody was watching
        watcher = Watcher(self.queue_limit(), last_seq=self.seq)
        replay, reason = self._replay(last_event_id)
        if replay is None:
            watcher.start = reason
            watcher.frames.extend(self._snapshot_frames(reason))
        else:
            watcher.start = "resume"
            watcher.frames.extend(replay)
        self.watchers.add(watcher)
        return watcher

    def _replay(self, last_event_id: str | None) -> tuple[list[bytes] | None, str]:
        """The changes after ``last_event_id``, or None and why a snapshot is needed."""
        if last_event_id is None:
            return None, CONNECT
        last = parse_last_event_id(last_event_id)
        if last is None or (last.epoch == self.epoch and last.seq > self.seq):
            return None, UNKNOWN_ID
        if last.epoch != self.epoch:
            return None, RESTARTED
        if last.partial:
            return None, PARTIAL
        oldest = self._history[0][0] if self._history else self.seq + 1
        if last.seq < oldest - 1:
            return None, EXPIRED
        frames = [data for seq, data in self._history if seq > last.seq]
        if len(frames) > self.queue_limit():
            return None, EXPIRED
        return frames, "resume"

    def _snapshot_frames(self, reason: str) -> list[bytes]:
        """A fresh snapshot: its ``snapshot`` event, then one event per rank; the last event's
        id is the plain ``EPOCH-SEQ`` (see ``exporter.feed.sse``)."""
        rows = list(self._rows.values())
        head = {
            "reason": reason,
            "epoch": self.epoch,
            "engines": [row.engine for row in rows],
            "poll": self._poll,
            "unix": round(self._wall(), 3),
        }
        last = len(rows)
        frames = [frame(SNAPSHOT, self._part_id(0, last), json_data(head))]
        for k, row in enumerate(rows, start=1):
            frames.append(frame(RANK, self._part_id(k, last), self._row_data(row)))
        return frames

    def _part_id(self, part: int, last: int) -> str:
        return event_id(self.epoch, self.seq, None if part == last else part)

    def status_json(self) -> dict[str, object]:
        """The feed in ``/status`` (``feeds.watch``)."""
        return {
            "watchers": len(self.watchers),
            "max_watchers": self.max_watchers,
            "epoch": self.epoch,
            "last_event_id": event_id(self.epoch, self.seq) if self.active else None,
            "events": self.counts.events,
            "dropped": self.counts.dropped,
            "refused": self.counts.refused,
        }

    def heartbeat(self, watcher: Watcher) -> bytes:
        """A heartbeat for ``watcher``: the id of the last change it has."""
        body = {"poll": self._poll, "unix": round(self._wall(), 3)}
        return frame(HEARTBEAT, event_id(self.epoch, watcher.last_seq), json_data(body))

    def drop(self, watcher: Watcher) -> None:
        """Drop a watcher that cannot keep up: its queue is emptied and its connection closed."""
        if watcher.ended:
            return
        watcher.dropped = True
        watcher.frames.clear()
        watcher.wake.set()
        self.watchers.discard(watcher)
        self.counts.dropped += 1
        if watcher.on_drop is not None:
            watcher.on_drop()

    def disconnect(self, watcher: Watcher) -> None:
        """The watcher's client went away (or its response ended)."""
        watcher.closed = True
        watcher.wake.set()
        self.watchers.discard(watcher)

    def close(self) -> None:
        """End every watcher (the exporter stops)."""
        for watcher in list(self.watchers):
            self.disconnect(watcher)


#: How often a quiet stream checks that its client is still connected.
GONE_CHECK_S = 1.0


async def stream(
    hub: WatchHub, watcher: Watcher, gone: Callable[[], bool] = lambda: False
) -> AsyncGenerator[bytes, None]:
    """What a server writes to ``watcher``'s client: everything queued in one write, a
    heartbeat after ``hub.heartbeat_s`` of nothing, until the hub drops or closes it, or
    ``gone()`` says the client left (checked every second while quiet, so its
    ``--max-watchers`` slot is free within a second, not at the next heartbeat). The caller
    disconnects the watcher when the response ends (``finally``)."""
    loop = asyncio.get_running_loop()
    while not watcher.ended:
        beat_at = loop.time() + hub.heartbeat_s
        frames: list[bytes] = []
        while not frames and not watcher.ended and not gone():
            left = beat_at - loop.time()
            if left <= 0:
                break
            frames = await watcher.take(min(left, GONE_CHECK_S))
        if watcher.ended or gone():
            return
        yield b"".join(frames) if frames else hub.heartbeat(watcher)
