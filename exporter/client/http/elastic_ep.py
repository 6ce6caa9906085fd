"""HTTP mode's elastic-EP read: each API server's ``POST /is_scaling_elastic_ep``, once a poll.

Started at the start of each poll beside its utility reads, never awaited by them: an answer
is recorded when it comes (the poll running then, or the next one, shows it), so a slow or
failing route never delays or fails ``is_sleeping``. One read per target at a time, bounded by
the poll's call timeout and ``MAX_ELASTIC_EP_ANSWER``, through the client's side pool (the
fault-tolerance read's, one connection per target kept open; a 5xx or a cut answer drops its
connection). A plugin-enabled target (URL ending in ``/dp``) is asked at its server's root,
where vLLM serves the route. 404, 405 or 501 (vLLM's Rust front end, a server that does not
serve ``generate``) is "unsupported here": no series, remembered, asked again after
``ELASTIC_EP_RECHECK_S`` or once the server was unreachable. Anything else that is not an
operation (a 503 from vLLM's shared store, another status, an unreadable answer, no answer) is
that target's ``problem`` until the next read. Nothing here raises into a poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp

from exporter.client.http.plugin import is_plugin_url, server_root
from exporter.client.http.routes import Retryable, Route, connection_error, exchange
from exporter.protocol.elastic_ep import (
    MAX_ELASTIC_EP_ANSWER,
    ElasticEpRead,
    UnreadableAnswer,
    error_detail,
    read_answer,
)

log = logging.getLogger("exporter.http")

ELASTIC_EP_ROUTE = Route("POST", "/is_scaling_elastic_ep", limit=MAX_ELASTIC_EP_ANSWER)
WHERE = f"{ELASTIC_EP_ROUTE.verb} {ELASTIC_EP_ROUTE.path}"
#: A server that answered "unsupported" is asked again after this long (or once unreachable).
ELASTIC_EP_RECHECK_S = 300.0
#: What a server without the route answers: Starlette's 404/405, the Rust front end's 404
#: (0.32 binary) or 501 (0.33 binary).
UNSUPPORTED_STATUSES = frozenset({404, 405, 501})


@dataclass(slots=True)
class TargetRead:
    """One target's read: where vLLM serves the route, the request in flight, when the
    server last said it has no such route, and what its last answer said."""

    label: str
    server_url: str
    last: ElasticEpRead
    task: asyncio.Task[None] | None = None
    missing_at: float | None = None


class ElasticEpReader:
    """Every target's ``TargetRead`` (targets in the client's order)."""

    def __init__(
        self,
        targets: list[tuple[str, str]],
        session: Callable[[], aiohttp.ClientSession],
        background: set[asyncio.Task[None]],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``targets``: (label, URL) of each target (a plugin target's read at its root)."""
        self._reads = [
            TargetRead(label, server_root(url) if is_plugin_url(url) else url, ElasticEpRead(label))
            for label, url in targets
        ]
        self._session = session
        self._background = background
        self._clock = clock
        self._wall = wall

    def reads(self) -> tuple[ElasticEpRead, ...]:
        return tuple(r.last for r in self._reads)

    def refresh(self, timeout_s: float, connected: Mapping[str, bool]) -> None:
        """Start this poll's read of every target that has none in flight; ``connected``: each
        target's label → whether its last request got an answer (a server that did not may
        come back as another vLLM: an "unsupported" is forgotten)."""
        for read in self._reads:
            if read.task is not None and not read.task.done():
                continue
            if read.missing_at is not None:
                if not connected.get(read.label, False):
                    read.missing_at = None
                elif self._clock() - read.missing_at < ELASTIC_EP_RECHECK_S:
                    continue
            task = read.task = asyncio.create_task(self._fetch(read, timeout_s))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _fetch(self, read: TargetRead, timeout_s: float) -> None:
        url = read.server_url
        try:
            reply = await asyncio.wait_for(
                exchange(self._session(), url, ELASTIC_EP_ROUTE), timeout_s
            )
        except asyncio.TimeoutError:
            self._problem(read, f"no answer from {WHERE} within {timeout_s:g}s")
            return
        except (Retryable, aiohttp.ClientError, OSError) as exc:
            self._problem(read, connection_error(url, exc))
            return
        except Exception as exc:  # the client closed meanwhile (no session), or a bug: never raised
            self._problem(read, f"not read: {type(exc).__name__}")
            return
        if reply.status in UNSUPPORTED_STATUSES:
            read.missing_at = self._clock()
            why = f"unsupported here: HTTP {reply.status} from {WHERE}"
            read.last = ElasticEpRead(
                read.label, problem=why, read_at_unix=self._wall(), supported=False
            )
            return
        if reply.cut:
            self._problem(read, f"answer from {WHERE} longer than {MAX_ELASTIC_EP_ANSWER} bytes")
            return
        if reply.status != 200:
            detail = error_detail(reply.body)
            suffix = f": {detail}" if detail else ""
            self._problem(read, f"HTTP {reply.status} from {WHERE}{suffix}")
            return
        try:
            operation = read_answer(reply.body)
        except UnreadableAnswer as exc:
            self._problem(read, f"unreadable answer from {WHERE}: {exc}")
            return
        read.last = ElasticEpRead(read.label, operation, read_at_unix=self._wall())

    def _problem(self, read: TargetRead, why: str) -> None:
        """No operation known for the target now (never the last one kept: it may be stale)."""
        log.debug("target %s: elastic-EP status not read: %s", read.label, why)
        read.last = ElasticEpRead(read.label, problem=why, read_at_unix=self._wall())
