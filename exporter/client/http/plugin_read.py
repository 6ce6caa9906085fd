"""How HTTP mode reads a plugin-enabled server (``PluginTargetState``): one ``GET <url>/gate``
shared by a poll's read methods becomes one outcome per rank.

The server's own fan-out waits up to its own call timeout for a hung engine, so its answer may
come after this poll's deadline: it then serves the next poll, if no older than two deadlines
(``LATE_ANSWERS``: the poller's reads only). Any other read (the gate's) is fresh: it uses only
a request started since it was asked, or times out, never the last answer. A request that
outlives two deadlines is abandoned (a body dripping a byte at a time is never waited for), and
every answer is read up to ``MAX_ANSWER``. Each rank's requests are those of
the answer the last read used (``plugin.gate_counts``; none after an answer that failed). Admin
actions are not relayed to such a server (it runs them on its own ``POST
<url>/admin/<action>``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import aiohttp

from exporter.client.fleet import LATE_ANSWERS, EngineOutcome, Outcome, timed_out
from exporter.client.http.plugin import (
    ACTION_HINT,
    GATE_KEYS,
    GateAnswer,
    gate_counts,
    gate_engines,
    gate_outcomes,
)
from exporter.client.http.routes import Reply, Retryable, Route, answer_too_long, connection_error
from exporter.client.http.target import PluginTargetState

#: A plugin target's gate answer serves the poll's read methods started this soon after.
PLUGIN_SHARE_S = 0.1
GATE_ROUTE = Route("GET", "/gate")

#: One request of a route to a target (the client's pool, its concurrency bound).
Fetch = Callable[[PluginTargetState, Route], Awaitable[Reply]]


class PluginReads:
    """The reads of every plugin-enabled target of one client."""

    def __init__(self, fetch: Fetch, dropped: Callable[[str], None]) -> None:
        self._fetch_route = fetch
        #: Called with the label of each engine whose rank the server stopped naming.
        self._dropped = dropped

    async def read(
        self,
        state: PluginTargetState,
        method: str,
        timeout_s: float,
        asked_at: float | None = None,
    ) -> list[EngineOutcome]:
        """One outcome per engine of ``state`` for read method ``method``, asked at
        ``asked_at`` (``time.monotonic``; None: now): the reads of one fan-out share it."""
        if method not in GATE_KEYS:
            hint = ACTION_HINT.format(url=state.target.url)
            return [EngineOutcome(label, Outcome.FAILED, error=hint) for label in state.labels()]
        since = time.monotonic() if asked_at is None else asked_at
        answer = await self._answer(state, timeout_s, since)
        if answer is None:
            state.forget_counts()
            return [timed_out(label, timeout_s) for label in state.labels()]
        if answer.error is not None:  # unreachable, over the read limit, or too slow
            state.forget_counts()
            kind, error = answer.kind, answer.error
            return [EngineOutcome(label, kind, error=error) for label in state.labels()]
        status, body, duration = answer.status, answer.body, answer.duration_s
        ranks = gate_engines(status, body)
        if ranks is not None:
            for label in state.follow(answer, ranks):  # ranks the server stopped naming
                self._dropped(label)
        if answer is not state.counted:  # once per answer, whichever read method reads it
            state.counted = answer
            counts = gate_counts(status, body) or {}
            state.rank_counts = {r: counts[r] for r in state.ranks if r in counts}
        if not state.ranks:  # nothing named yet: the target stands for its engines
            (outcome,) = gate_outcomes(state.target.label, ["?"], method, status, body, duration)
            return [EngineOutcome(state.target.label, outcome.outcome, error=outcome.error)]
        return gate_outcomes(state.target.label, state.ranks, method, status, body, duration)

    async def _answer(
        self, state: PluginTargetState, timeout_s: float, since: float
    ) -> GateAnswer | None:
        """A gate answer for this read: one ``GET <url>/gate`` shared by the reads of a fan-out.
        A fresh read uses only a request started at or after ``since`` and times out without
        one; the poll's (``LATE_ANSWERS``) also shares one started within ``PLUGIN_SHARE_S`` or
        still running, and past its deadline takes the last answer no older than two deadlines.
        None: no answer to use (every engine of the target timed out)."""
        late = LATE_ANSWERS.get()
        task = state.sample
        if task is None or not _shares(state, task, since, late):
            state.sampled_at = time.monotonic()
            task = state.sample = asyncio.ensure_future(self._fetch(state, timeout_s))
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s * 0.9)
        except asyncio.TimeoutError:
            if not late:  # a fresh read: the last answer was asked for before it
                return None
            recent = time.monotonic() - state.answered_at < 2 * timeout_s
            return state.answered if recent else None

    async def _fetch(self, state: PluginTargetState, timeout_s: float) -> GateAnswer:
        """One ``GET <url>/gate``, given up after two deadlines (it may serve the next poll,
        not the one after), its answer read up to ``MAX_ANSWER``."""
        started = time.perf_counter()
        try:
            reply = await asyncio.wait_for(self._fetch_route(state, GATE_ROUTE), 2 * timeout_s)
        except asyncio.TimeoutError:
            state.connected = False
            error = f"no whole answer from /dp/gate within {2 * timeout_s:g}s: abandoned"
            return GateAnswer.failed(Outcome.TIMEOUT, error, time.perf_counter() - started)
        except (Retryable, aiohttp.ClientError, OSError) as exc:
            state.connected = False
            state.fault_read.reconnected()
            error = connection_error(state.target.url, exc)
            return GateAnswer.failed(Outcome.DISCONNECTED, error, time.perf_counter() - started)
        duration = time.perf_counter() - started
        state.connected = reply.status in (200, 412)
        if reply.cut:
            error = answer_too_long("/dp/gate", GATE_ROUTE.limit)
            return GateAnswer.failed(Outcome.FAILED, error, duration)
        state.answered = GateAnswer(reply.status, reply.body, duration)
        state.answered_at = time.monotonic()
        return state.answered


def _shares(
    state: PluginTargetState, task: asyncio.Task[GateAnswer], since: float, late: bool
) -> bool:
    """Whether a read asked at ``since`` uses the request ``task`` (started at
    ``state.sampled_at``): one started since, or, for the poll, one running or just started."""
    if state.sampled_at >= since:
        return True
    return late and (not task.done() or time.monotonic() - state.sampled_at < PLUGIN_SHARE_S)
