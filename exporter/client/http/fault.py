"""HTTP mode's fault-tolerance read: vLLM 0.33's ``GET /fault_tolerance/status`` per target, or
``GET /v1/fault_tolerance/status`` where a later vLLM serves it (vLLM's open PR #46370).

Asked beside each fan-out's ``is_sleeping`` (once per poll and per gate sample), through a
connection pool of its own kept open from poll to poll, so the dev routes' pool stays theirs.
A plain target is one engine to the exporter and gets the worst of its ranks; a plugin-enabled
target (URL ending in ``/dp``) is asked at its server's root, where vLLM serves the route, and
each of its ranks gets its own status (``<target>/<rank>``, only the ranks its ``/dp/gate``
named).
The route that answered last is asked first (per target); when it answers 404/405 the other
is asked at once, and remembered if it answers. A server with neither (fault tolerance off, or
an older vLLM) has no status and is asked again after it was unreachable, or after
``FT_RECHECK_S``. An answer that cannot be read (another
status, a 5xx, not JSON, a garbled entry) makes the ranks it covers ``unknown`` (never healthy,
never the last status kept) and is counted (``BAD_FT_STATUS``). Nothing here raises into a
poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from exporter.base.faults import ProtocolErrorTally
from exporter.client.http.plugin import engine_label
from exporter.client.http.replies import MAX_FT_ANSWER, fault_entries, worst_fault_status
from exporter.client.http.routes import Reply, Retryable, Route, exchange
from exporter.client.pushes import BAD_FT_STATUS, PushBook

log = logging.getLogger("exporter.http")

FT_PATH = "/fault_tolerance/status"
#: Where vLLM serves the route: at the root (0.33), under ``/v1/`` (PR #46370, if it lands).
FT_ROUTES = (Route("GET", FT_PATH), Route("GET", "/v1" + FT_PATH))
#: A server that answered 404/405 on both is asked again after this long (or a reconnection).
FT_RECHECK_S = 300.0


@dataclass(slots=True)
class FaultRead:
    """One target's read: where vLLM serves the route, whether its ranks are engines of their
    own, the request in flight, when the server last said it has neither route, and which
    route (index into ``FT_ROUTES``) answered last."""

    label: str
    server_url: str
    per_rank: bool
    task: asyncio.Task[None] | None = None
    #: When ``task`` was started (monotonic): a fresh read never joins one started before it.
    started_at: float = 0.0
    missing_at: float | None = None
    route: int = 0

    def reconnected(self) -> None:
        """The server was unreachable: it may come back as another vLLM; ask again."""
        self.missing_at = None


class FaultStatusReader:
    """Every target's ``FaultRead``, recorded in ``pushes`` (so ``since_unix`` holds)."""

    def __init__(
        self,
        pushes: PushBook,
        faults: ProtocolErrorTally,
        session: Callable[[], aiohttp.ClientSession],
        background: set[asyncio.Task[None]],
    ) -> None:
        self._pushes = pushes
        self._faults = faults
        self._session = session
        self._background = background

    def refresh(
        self, read: FaultRead, labels: list[str], timeout_s: float
    ) -> asyncio.Task[None] | None:
        """This fan-out's read of ``read``'s target (the one still running, if any); None while
        the server is known to lack the route. ``labels``: the target's engines now."""
        if read.task is not None and not read.task.done():
            return read.task
        if read.missing_at is not None and time.monotonic() - read.missing_at < FT_RECHECK_S:
            return None
        read.started_at = time.monotonic()
        task = read.task = asyncio.create_task(self._fetch(read, labels, timeout_s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def fresh(
        self, read: FaultRead, labels: list[str], timeout_s: float, asked_at: float, deadline: float
    ) -> None:
        """A read that started at or after ``asked_at``, awaited until ``deadline`` (a gate's:
        its ``healthy`` condition must not pass on a status read before it was asked). One
        still running from earlier is waited for first (one read at a time per server); a read
        not done by the deadline leaves the target's ranks ``unknown``, never the status kept."""
        task = read.task
        if task is not None and not task.done() and read.started_at < asked_at:
            await asyncio.wait((task,), timeout=max(0.0, deadline - time.monotonic()))
            if not task.done():
                self._not_in_time(read, labels)
                return
        task = self.refresh(read, labels, timeout_s)
        if task is None:
            return
        await asyncio.wait((task,), timeout=max(0.0, deadline - time.monotonic()))
        if not task.done():
            self._not_in_time(read, labels)

    def _not_in_time(self, read: FaultRead, labels: list[str]) -> None:
        for label in labels if read.per_rank else [read.label]:
            if label in self._pushes.fault_status:
                self._pushes.set_unknown(label, "not read: no answer before the gate's deadline")

    async def _fetch(self, read: FaultRead, labels: list[str], timeout_s: float) -> None:
        try:
            reply = await asyncio.wait_for(self._ask(read), timeout_s)
        except (Retryable, aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            # Unreachable or slow: not known now (a status kept from before could be stale).
            for label in labels if read.per_rank else [read.label]:
                if label in self._pushes.fault_status:
                    self._pushes.set_unknown(label, f"not read: {type(exc).__name__}")
            return
        if reply is None:
            read.missing_at = time.monotonic()
            for label in labels:
                self._pushes.forget(label)
            return
        if reply.status != 200:
            path = FT_ROUTES[read.route].path
            self._unreadable(read, labels, f"HTTP {reply.status} from {path}")
            return
        try:
            ranks = fault_entries(reply.body)
        except ValueError as exc:
            self._unreadable(read, labels, str(exc))
            return
        if not read.per_rank:
            found = worst_fault_status(ranks)
            for rank in ranks:
                if rank.problem is not None:
                    self._faults.record(
                        BAD_FT_STATUS, f"target {read.label} rank {rank.rank}: {rank.problem}"
                    )
            if found is not None:
                self._pushes.set_fault_status(read.label, *found)
            return
        if labels == [read.label]:  # its gate has not named the ranks yet: nothing to match
            return
        by_label = {engine_label(read.label, str(r.rank)): r for r in ranks}
        for label in labels:  # ranks the server's gate named: a hostile answer adds no engine
            rank_status = by_label.get(label)
            if rank_status is None:
                self._pushes.set_unknown(label, "unreadable status: not in the server's answer")
                self._faults.record(BAD_FT_STATUS, f"target {read.label}: {label} not named")
            else:
                self._pushes.record(label, rank_status, BAD_FT_STATUS)

    async def _ask(self, read: FaultRead) -> Reply | None:
        """The answer of the route ``read``'s server serves: the one that answered last first,
        the other when it answers 404/405 (then remembered); None when neither exists."""
        for index in (read.route, 1 - read.route):
            route = FT_ROUTES[index]
            reply = await exchange(self._session(), read.server_url, route, MAX_FT_ANSWER)
            if reply.status not in (404, 405):
                read.route = index
                return reply
        return None

    def _unreadable(self, read: FaultRead, labels: list[str], why: str) -> None:
        """An answer that cannot be read as a whole: no rank's status is known (fail closed:
        every engine of the target ``unknown``, never the last status kept), counted."""
        self._faults.record(BAD_FT_STATUS, f"target {read.label}: {why}")
        for label in labels if read.per_rank else [read.label]:
            self._pushes.set_unknown(label, f"unreadable status: {why}")
