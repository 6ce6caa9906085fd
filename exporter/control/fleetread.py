"""``FleetRead``: the one way the poller and the gate ask every engine the read methods.

Both ask a set of read invariants of every engine concurrently, under one shared deadline, and
both must skip what an engine already said it does not have (an older vLLM: asked again only
after it handshakes again). Keeping that memory here, once, means the gate never asks an engine
a question the poller learnt it cannot answer, and the two cannot drift apart. A read comes
back as one ``FleetReading``: the outcomes and the engines' details as the read left them, so
neither the poller nor the gate reads the client again to decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineDetail, EngineOutcome, FleetClient, Outcome
from exporter.client.observe import progress_of, work_counts
from exporter.fleetstate.activity import held_without_progress
from exporter.fleetstate.invariants import (
    HAS_WORK,
    ON_DEMAND,
    READS,
    Invariant,
    is_unsupported,
    require_type,
)
from exporter.protocol.progress import RankProgress

log = logging.getLogger("exporter.poller")
#: Every read method: what each poll asks, and a gate without conditions.
ALL_METHODS = frozenset(inv.method for inv in READS)
#: The failure text of an engine not asked because it said it has no such method.
#: ``/status``'s ``last_poll.source`` of a process that reads the engines itself, alone.
ALONE: Mapping[str, Any] = {"role": "alone", "from": "self", "age_s": None, "reason": None}
KNOWN_UNSUPPORTED = "unsupported by this engine (it said so before; asked again after it restarts)"


async def _nothing() -> list[EngineOutcome]:
    return []


async def _turns_later(
    turns: int,
    method: str,
    client: FleetClient,
    timeout_s: float,
    engines: Collection[str] | None,
) -> list[EngineOutcome]:
    """``method`` asked of ``engines`` once the loop turned ``turns`` times: a paced poll's
    burst sends its methods a turn apart (in-process mode sends on vLLM's loop: three methods
    to a burst's engines are three short stretches, not one), each under the call timeout. A
    read of every engine sends them in the same turn: HTTP mode's plugin target answers the
    methods asked together with one request (``calls_per_engine``), and it is never paced."""
    for _ in range(turns):
        await asyncio.sleep(0)
    return await client.call_utility(method, timeout_s=timeout_s, engines=engines)


def stall_candidates(
    progress: Mapping[str, RankProgress] | None, stall_after_s: float, now_unix: float
) -> frozenset[str]:
    """The ranks that would read stalled now by their progress alone
    (``held_without_progress``): a listening poll asks them ``has_work`` itself, so a rank
    reads stalled only on the engine's own answer (0: stalls are not looked for)."""
    if not progress:
        return frozenset()
    return frozenset(
        engine
        for engine, made in progress.items()
        if held_without_progress(made, now_unix, stall_after_s)
    )


@dataclass(frozen=True)
class FleetReading:
    """One read of the fleet: what the poller publishes and the gate decides on."""

    #: Method → one type-checked outcome per engine (one known not to have it: said so).
    outcomes: Mapping[str, list[EngineOutcome]]
    #: The engines the read asked, in the client's order.
    engines: tuple[str, ...]
    #: Engine → its details once the read ended: what the fan-out learnt (HTTP mode reads the
    #: request counts with ``has_work`` and the fault statuses with ``is_sleeping``; in-process
    #: mode's counts are read after ``has_work`` answered, never before).
    details: Mapping[str, EngineDetail]
    #: The engines the client knows once the read ended (a plugin-enabled HTTP target may have
    #: named other ranks in its answers).
    known_after: tuple[str, ...]
    #: Engine → its forward progress as the read began (absent: unknown; a listening poll
    #: picks its stall candidates by it); None where the mode has no source of it, or the read
    #: was not asked for it (``read(progress=True)``).
    progress: Mapping[str, RankProgress] | None = None


class FleetRead:
    """Reads of the fleet through ``client``, with the memory of unsupported methods."""

    def __init__(self, client: FleetClient) -> None:
        self._client = client
        #: method → {engine: its handshake count when it said it has no such method}.
        self._unsupported: dict[str, dict[str, int]] = {}
        #: The details a paced poll's first burst read, for its other earlier bursts.
        self._burst_details: dict[str, EngineDetail] | None = None

    def unsupported_by(self, engine: str) -> frozenset[str]:
        """The read methods ``engine`` said it does not have."""
        return frozenset(m for m, per_engine in self._unsupported.items() if engine in per_engine)

    def unsupported_everywhere(self, method: str, engines: Collection[str]) -> bool:
        return bool(engines) and set(self._unsupported.get(method, ())) >= set(engines)

    def describe(self) -> dict[str, Any]:
        """The poller's source when this process reads alone (``exporter.control.sources``)."""
        return dict(ALONE)

    async def read(
        self,
        methods: Collection[str],
        timeout_s: float,
        *,
        progress: bool = False,
        engines: Collection[str] | None = None,
        listen: float | None = None,
    ) -> FleetReading:
        """Every method of ``methods`` the attach mode supports, on every engine (or on
        ``engines``: a paced poll's burst), all calls sharing one deadline. An engine known
        not to have a method is not asked; its outcome says so (``is_unsupported``). The
        details of every engine are read before (whom to ask, and whether it restarted) and
        once after the calls: the one read after a fan-out (not after a paced poll's earlier
        burst: ``engines`` without ``progress``). ``progress``: each engine's progress too
        (the poll's; a gate decides without it). ``listen`` (a poll's reads, with its
        ``--stall-after``): where the mode's request counts tell a rank's activity,
        ``has_work`` is taken from them (``observe.WORK_COUNTS``), not asked (``told``), but
        for a stall candidate (``stall_candidates``); None (the gate, an action): every engine
        is asked."""
        try:
            return await self._read(methods, timeout_s, progress, engines, listen)
        except BaseException:  # a paced poll cut short: its next starts with fresh details
            self._burst_details = None
            raise

    async def _read(
        self,
        methods: Collection[str],
        timeout_s: float,
        progress: bool,
        engines: Collection[str] | None,
        listen: float | None,
    ) -> FleetReading:
        client = self._client
        # A paced poll's earlier burst: its reading's details are not used (the poll's are the
        # last burst's), so the engines' details are not read again after it (256 of them,
        # 15 times), nor before it but for the poll's first (``_details_before``).
        early = engines is not None and not progress
        before = self._details_before(engines is not None)
        asked = [
            inv
            for inv in (*READS, *ON_DEMAND)  # an on-demand read only when asked for by name
            if inv.method in methods and inv.method in client.capabilities.methods
        ]
        # The engines asked, in the details' order (a burst's own, not every engine walked).
        wanted = list(before) if engines is None else [e for e in engines if e in before]
        found = progress_of(client.observations) if progress else None
        told = self._told(asked, wanted, None if engines is None else wanted, listen, found)
        calls, skipped = self._calls(asked, wanted, engines is None, told, timeout_s)
        results: dict[str, list[EngineOutcome]] = {}
        for inv, outcomes, known in zip(asked, await asyncio.gather(*calls), skipped, strict=True):
            self._remember(inv.method, outcomes, before)
            said = [EngineOutcome(e, Outcome.FAILED, error=KNOWN_UNSUPPORTED) for e in known]
            extra = list(told.values()) if inv is HAS_WORK else []
            results[inv.method] = require_type(inv, [*outcomes, *extra, *said])
        if early:
            return FleetReading(results, tuple(before), before, tuple(before), found)
        # The details afresh in a turn of their own (in-process: 256 engines' details are
        # read on vLLM's loop, the outcomes above were checked in this one).
        await asyncio.sleep(0)
        self._burst_details = None  # the next paced poll's first burst reads them afresh
        after = {d.engine: d for d in client.engine_details()}
        return FleetReading(
            results,
            tuple(before),
            {engine: after.get(engine, d) for engine, d in before.items()},
            tuple(client.engine_labels),
            found,
        )

    def _details_before(self, burst: bool) -> dict[str, EngineDetail]:
        """The engines' details before a read, read afresh, but for a paced poll's bursts
        after its first: they take the first's (a poll at 256 engines reads them twice, before
        its first burst and after its last, not seventeen times; a restart between bursts is
        seen by the read after the last, and its methods asked again from the next poll)."""
        if burst and self._burst_details is not None:
            return self._burst_details
        before = {d.engine: d for d in self._client.engine_details()}
        self._forget_restarted(before)
        self._burst_details = before if burst else None
        return before

    def _calls(
        self,
        asked: Collection[Invariant],
        wanted: list[str],
        every: bool,
        told: Mapping[str, EngineOutcome],
        timeout_s: float,
    ) -> tuple[list[Awaitable[list[EngineOutcome]]], list[list[str]]]:
        """Each asked method's fan-out (to ``every`` engine, or to the ``wanted`` ones), less
        the engines known not to have it (returned) and, for ``has_work``, the ``told`` ones."""
        calls: list[Awaitable[list[EngineOutcome]]] = []
        skipped: list[list[str]] = []
        for inv in asked:
            skip = self._unsupported.get(inv.method, {})
            own = told if inv is HAS_WORK else {}
            skipped.append([e for e in wanted if e in skip and e not in own])
            targets = (
                None
                if every and not skip and not own
                else [e for e in wanted if e not in skip and e not in own]
            )
            calls.append(
                _nothing()
                if targets == []  # every engine told: nothing to send
                else _turns_later(
                    0 if every else len(calls), inv.method, self._client, timeout_s, targets
                )
            )
        return calls, skipped

    def _told(
        self,
        asked: Collection[Invariant],
        wanted: list[str],
        scope: Collection[str] | None,
        listen: float | None,
        progress: Mapping[str, RankProgress] | None,
    ) -> dict[str, EngineOutcome]:
        """Engine → its ``has_work`` as its request counts tell it, for the engines of
        ``wanted`` a listening poll need not ask (``read``); the counts read are ``scope``'s
        (None: every engine's)."""
        if listen is None or HAS_WORK not in asked:
            return {}
        counts = work_counts(self._client.observations, scope)
        if not counts:
            return {}
        if progress is None and listen > 0:  # a paced poll's earlier burst: read it here
            progress = progress_of(self._client.observations, scope)
        # A rank whose vLLM lacks has_work is told too: its counts say what it holds.
        candidates = stall_candidates(progress, listen, time.time())
        return {
            e: EngineOutcome(e, Outcome.OK, counts[e].total > 0, told=True)
            for e in wanted
            if e in counts and e not in candidates
        }

    def _remember(
        self, method: str, outcomes: list[EngineOutcome], details: Mapping[str, EngineDetail]
    ) -> None:
        for o in outcomes:
            if o.outcome is Outcome.FAILED and is_unsupported(o) and o.engine in details:
                self._unsupported.setdefault(method, {})[o.engine] = details[o.engine].handshakes
                log.info("engine %s does not support %s: not asked again", o.engine, method)

    def _forget_restarted(self, details: Mapping[str, EngineDetail]) -> None:
        """An engine that handshook again may run another vLLM: ask it everything again."""
        for per_engine in self._unsupported.values():
            for engine, handshakes in list(per_engine.items()):
                detail = details.get(engine)
                if detail is None or detail.handshakes != handshakes:
                    del per_engine[engine]
