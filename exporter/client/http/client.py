"""HTTP attach mode: one vLLM API server per target, reached through its dev endpoints.

Each target (``--http-target URL`` or ``NAME=URL``, repeatable, and ``--http-targets-file``)
is one "engine" to the layers above: its label is its name, or its position ("0", "1", ...).
A target's own answer is already vLLM's aggregate over the ranks that API server manages, so an
API server whose engines disagree (HTTP 500 "Engines returned different is_sleeping results:
[...]") becomes an ``INCONSISTENT`` outcome carrying those values
(``docs/protocol.md`` F.4 / F.4.1).

Each allow-listed utility method maps to one dev or RL route (F.4): the table is
``exporter.client.http.routes``'s docstring; replies: ``replies``.
A 404 on a route other than the two oldest dev routes is "unsupported" (``UNSUPPORTED_HINT``).

A target's fault-tolerance status (vLLM 0.33 ``--enable-fault-tolerance``) is read beside each
fan-out's ``is_sleeping`` (``exporter.client.http.fault``): the worst of its ranks, or each rank
of a plugin-enabled target. Each server's elastic-EP operation (``POST /is_scaling_elastic_ep``)
is read once a poll, beside the utility reads and never on their path (``elastic_ep``).

``has_work`` and the running and waiting requests (``EngineDetail.requests``): vLLM has no route
for ``EngineCore.has_work``, so a dev-routes target's comes from its ``GET /metrics``
(``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, one series per ``engine``
label, summed over the target's ranks): ``has_work`` is running + waiting > 0 — vLLM's batch
queue and DP wave, which ``has_work`` also counts, are invisible there. A server without those
families (``--disable-log-stats``) is unsupported for it, never idle; an unreadable answer
fails closed (``replies.read_activity``). The counts are those of the last ``has_work`` read
(None after any failure). A plugin-enabled target answers per rank: the server's own ``has_work``
utility call and its front end's counts, from its ``/dp/gate`` (``plugin``).

One ``aiohttp.ClientSession`` per client (connection pooling), all targets called concurrently
under one shared deadline and a concurrency bound. vLLM closes the TCP connection after every
500 without saying so: such connections are never put back into the pool, and a request that hits
a reset on a pooled connection is retried once on a fresh one. The bearer token is sent to every
target and kept out of logs, reprs and error texts.

Every answer is read up to a fixed limit (``routes.MAX_ANSWER``; the weight checksums'
``MAX_CHECKSUM_ANSWER``): a longer one is a failed call naming the limit, its connection dropped.
A dev route's read ends with the fan-out's deadline; a plugin target's gate read, which may
serve the next poll (never a gate: ``plugin_read``), is abandoned after two deadlines (a body
dripping a byte at a time), the target's engines ``timeout`` for that poll and the next poll
asks afresh.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.base.faults import ProtocolErrorTally
from exporter.client.fleet import (
    DEFAULT_ALLOWED_METHODS,
    LATE_ANSWERS,
    Capabilities,
    EngineDetail,
    EngineOutcome,
    Outcome,
    check_allowed,
    stopping,
    timed_out,
)
from exporter.client.http.elastic_ep import ElasticEpReader
from exporter.client.http.fault import FaultStatusReader
from exporter.client.http.plugin_read import PluginReads
from exporter.client.http.progress import ProgressReads
from exporter.client.http.replies import interpret, read_activity
from exporter.client.http.routes import (
    ROUTED_METHODS,
    Reply,
    Retryable,
    Route,
    answer_too_long,
    connection_error,
    exchange,
    route,
)
from exporter.client.http.target import HttpTarget as HttpTarget  # callers import it from here
from exporter.client.http.target import (
    PluginTargetState,
    TargetState,
    front_end_of,
    target_state,
)
from exporter.client.observe import ELASTIC_EP_OPERATION, PROGRESS, Observation, Observations
from exporter.client.pushes import PushBook
from exporter.protocol.handshake import MAX_REGISTRATION_STRING
from exporter.protocol.strings import bound_text

log = logging.getLogger("exporter.http")

#: At most this many requests in flight per client (across all targets).
DEFAULT_MAX_CONCURRENCY = 64
VERSION_TIMEOUT_S = 5.0


@dataclass
class HttpFleetClient:
    """``FleetClient`` over vLLM API servers' dev endpoints (see the module docstring)."""

    targets: list[HttpTarget]
    token: str | None = field(default=None, repr=False)
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS
    #: Where malformed fault-tolerance answers are counted (the exporter's own tally).
    faults: ProtocolErrorTally = field(default_factory=ProtocolErrorTally, repr=False)

    def __post_init__(self) -> None:
        self.pushes = PushBook(self.faults)
        self._states = [target_state(t) for t in self.targets]
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._side: aiohttp.ClientSession | None = None
        self._semaphore = asyncio.Semaphore(self.max_concurrency)
        self._background: set[asyncio.Task[None]] = set()
        self._fault_reads = FaultStatusReader(
            self.pushes, self.faults, self._side_session, self._background
        )
        self._plugin = PluginReads(self._gate_request, self.pushes.drop)
        self._elastic = ElasticEpReader(
            [(t.label, t.url) for t in self.targets],
            self._side_session,
            self._background,
        )
        self.retries = 0
        self._closed = False
        self._capabilities = Capabilities(
            fault_status=True,
            request_counts=True,
            methods=self.allowed_methods & DEFAULT_ALLOWED_METHODS & ROUTED_METHODS,
            calls_per_engine=False,
        )
        #: Each server's elastic-EP operation, read once per poll off the poll's path.
        self.observations = Observations()
        self.observations.add_source(ELASTIC_EP_OPERATION, self._elastic_ep_operations)
        self.observations.add_refresher(self._refresh_elastic_ep)
        #: Each dev-routes target's computed tokens, read with has_work (``progress``).
        self._progress = ProgressReads()
        self.observations.add_source(PROGRESS, lambda: self._progress.observations(self._states))

    # -- FleetClient -----------------------------------------------------------------------

    @property
    def engine_labels(self) -> list[str]:
        return [label for s in self._states for label in s.labels()]

    def engine_details(self) -> list[EngineDetail]:
        return [
            EngineDetail(
                engine=label,
                connected=s.connected,
                address=s.target.url,
                vllm_version=s.vllm_version,
                front_end=s.front_end,
                rust_frontend_version=s.rust_frontend_version,
                fault_status=self.pushes.fault_status.get(label),
                requests=counts,
            )
            for s in self._states
            for label, counts in s.counts_by_label().items()
        ]

    @property
    def capabilities(self) -> Capabilities:
        """Every target is asked for its fault-tolerance status (one without the route has
        none) and its requests (``/metrics``, or a plugin's ``/dp/gate``); the methods are the
        allow-listed ones with a route (whether a given server has it shows in its answer:
        ``UNSUPPORTED_HINT``)."""
        return self._capabilities

    def _refresh_elastic_ep(self, timeout_s: float) -> None:
        """Each server's ``POST /is_scaling_elastic_ep``, not awaited (``elastic_ep``)."""
        if not self._closed and self._side is not None:
            self._elastic.refresh(timeout_s, {s.target.label: s.connected for s in self._states})

    def _elastic_ep_operations(self) -> list[Observation]:
        return [
            Observation(
                read.target,
                ELASTIC_EP_OPERATION,
                read,
                read.read_at_unix or 0.0,
                "POST /is_scaling_elastic_ep",
            )
            for read in self._elastic.reads()
        ]

    async def start(self) -> None:
        self._closed = False
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"

        # Deadlines are ours (one per fan-out), not aiohttp's. Retries go through a connector
        # that never reuses a connection; the per-poll fault-tolerance read keeps its own pool
        # (one connection per target kept open, the dev routes' pool untouched).
        def session(force_close: bool) -> aiohttp.ClientSession:
            connector = aiohttp.TCPConnector(force_close=force_close, limit=self.max_concurrency)
            timeout = aiohttp.ClientTimeout(total=None)
            return aiohttp.ClientSession(
                headers=headers, timeout=timeout, connector=connector, raise_for_status=False
            )

        self._session, self._fresh, self._side = session(False), session(True), session(False)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        for session in (self._session, self._fresh, self._side):
            if session is not None:
                await session.close()
        self._session = self._fresh = self._side = None

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        """Call ``method`` on every target at once (only those labelled in ``engines`` when
        given); one outcome per called target, in target order."""
        check_allowed(method, self.allowed_methods)
        asked_at = time.monotonic()  # a fresh read uses only answers to requests sent since
        spec = route(method, args)
        wanted = None if engines is None else set(engines)
        states = [s for s in self._states if wanted is None or not wanted.isdisjoint(s.labels())]
        if self._closed:
            labels = [label for s in states for label in s.labels()]
            return [stopping(label) for label in labels if wanted is None or label in wanted]
        tasks = {
            s.target.label: asyncio.create_task(
                self._call_target(s, method, spec, timeout_s, asked_at)
            )
            for s in states
        }
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks.values(), timeout=timeout_s)
        finally:
            for task in tasks.values():
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        results: list[EngineOutcome] = []
        for s in states:
            task = tasks[s.target.label]
            if task.cancelled():  # slow, not gone: a server that stops answering reads as hung
                results.extend(timed_out(label, timeout_s) for label in s.labels())
                continue
            exc = task.exception()
            if exc is not None:  # a bug, not the target: keep it visible but do not crash polls
                log.error("%s on target %s: %s", method, s.target.label, type(exc).__name__)
                results.extend(
                    EngineOutcome(label, Outcome.FAILED, error=type(exc).__name__)
                    for label in s.labels()
                )
            else:
                results.extend(task.result())
        if self._closed:  # closed while these calls were in flight: nothing was read for them
            results = [o if o.ok else stopping(o.engine) for o in results]
        if wanted is not None:
            results = [o for o in results if o.engine in wanted]
        return results

    async def _call_target(
        self, state: TargetState, method: str, spec: Route, timeout_s: float, asked_at: float
    ) -> list[EngineOutcome]:
        if method != "is_sleeping":
            return await self._read_target(state, method, spec, timeout_s, asked_at)
        # Awaited within this deadline, so that this poll (or gate sample) reads the fresh
        # status. The poll's: a slower answer is recorded when it comes, for the next one. Any
        # other read's (a gate's ``healthy``): only a read started since it was asked, and
        # ``unknown`` when none came in time (``FaultStatusReader.fresh``).
        deadline = time.monotonic() + timeout_s * 0.9
        reads, labels = self._fault_reads, state.labels()
        if not LATE_ANSWERS.get():
            fresh = reads.fresh(state.fault_read, labels, timeout_s, asked_at, deadline)
            outcomes, _ = await asyncio.gather(
                self._read_target(state, method, spec, timeout_s, asked_at), fresh
            )
            return outcomes
        ft = reads.refresh(state.fault_read, labels, timeout_s)
        outcomes = await self._read_target(state, method, spec, timeout_s, asked_at)
        if ft is not None:
            await asyncio.wait((ft,), timeout=max(0.0, deadline - time.monotonic()))
        return outcomes

    async def _read_target(
        self, state: TargetState, method: str, spec: Route, timeout_s: float, asked_at: float
    ) -> list[EngineOutcome]:
        if isinstance(state, PluginTargetState):
            return await self._plugin.read(state, method, timeout_s, asked_at)
        return [await self._call_one(state, method, spec)]

    async def _gate_request(self, state: PluginTargetState, spec: Route) -> Reply:
        async with self._semaphore:
            return await self._request(self._pooled(), state, spec)

    # -- one target --------------------------------------------------------------------------

    async def _call_one(self, state: TargetState, method: str, spec: Route) -> EngineOutcome:
        if method != "has_work":
            return await self._exchange_one(state, method, spec)
        # The counts go with the has_work read: unknown after any failure, a late one too.
        try:
            outcome = await self._exchange_one(state, method, spec)
        except BaseException:
            state.request_counts = state.progress = None
            raise
        if not outcome.ok:
            state.request_counts = state.progress = None
        return outcome

    async def _exchange_one(self, state: TargetState, method: str, spec: Route) -> EngineOutcome:
        label = state.target.label
        async with self._semaphore:
            started = time.perf_counter()
            try:
                try:
                    reply = await self._request(self._pooled(), state, spec)
                except Retryable:
                    self.retries += 1
                    log.debug("target %s: pooled connection was reset, retrying once", label)
                    reply = await self._request(self._fresh_session(), state, spec)
            except (Retryable, aiohttp.ClientError, OSError) as exc:
                state.connected = False
                state.fault_read.reconnected()
                return EngineOutcome(
                    label, Outcome.DISCONNECTED, error=connection_error(state.target.url, exc)
                )
            duration = time.perf_counter() - started
            state.connected = True
            if state.vllm_version is None and not state.version_pending:
                state.version_pending = True
                task = asyncio.create_task(self._fetch_version(state))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            if reply.cut:  # over the read limit: refused, its connection already dropped
                error = answer_too_long(spec.path, spec.limit)
                return EngineOutcome(label, Outcome.FAILED, error=error, duration_s=duration)
            if method == "has_work":  # GET /metrics: the outcome, the counts, the tokens
                outcome, state.request_counts = read_activity(
                    label, reply.status, reply.body, duration
                )
                self._progress.read(state, reply.body if outcome.ok else None)
                return outcome
            return interpret(label, method, reply.status, reply.body, duration)

    async def _fetch_version(self, state: TargetState) -> None:
        """``GET /version`` once, off the poll path; a failure is retried on a later poll."""
        try:
            reply = await asyncio.wait_for(
                # A one-off request: on a fresh connection, leaving the pool to the polls.
                self._request(self._fresh_session(), state, Route("GET", "/version")),
                VERSION_TIMEOUT_S,
            )
            data = json.loads(reply.body) if reply.status == 200 else None
            if isinstance(data, dict) and isinstance(data.get("version"), str):
                # The registration's rule for the same string (a label of every scrape).
                state.vllm_version = bound_text(data["version"][:MAX_REGISTRATION_STRING])
                state.front_end, state.rust_frontend_version = front_end_of(data)
        except (Retryable, aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
            log.debug("target %s: no vLLM version", state.target.label)
        finally:
            state.version_pending = False

    def _pooled(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("HttpFleetClient.start() was not called")
        return self._session

    def _side_session(self) -> aiohttp.ClientSession:
        if self._side is None:
            raise RuntimeError("HttpFleetClient.start() was not called")
        return self._side

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self._fresh is None:
            raise RuntimeError("HttpFleetClient.start() was not called")
        return self._fresh

    async def _request(
        self,
        session: aiohttp.ClientSession,
        state: TargetState,
        spec: Route,
        limit: int | None = None,
    ) -> Reply:
        state.requests += 1
        return await exchange(session, state.target.url, spec, limit)
