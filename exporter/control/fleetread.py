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
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineDetail, EngineOutcome, FleetClient, Outcome
from exporter.client.observe import progress_of
from exporter.fleetstate.invariants import ON_DEMAND, READS, is_unsupported, require_type
from exporter.protocol.progress import RankProgress

log = logging.getLogger("exporter.poller")
#: Every read method: what each poll asks, and a gate without conditions.
ALL_METHODS = frozenset(inv.method for inv in READS)
#: The failure text of an engine not asked because it said it has no such method.
#: ``/status``'s ``last_poll.source`` of a process that reads the engines itself, alone.
ALONE: Mapping[str, Any] = {"role": "alone", "from": "self", "age_s": None, "reason": None}
KNOWN_UNSUPPORTED = "unsupported by this engine (it said so before; asked again after it restarts)"


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
    #: Engine → its forward progress once the read ended (absent: unknown); None where the
    #: mode has no source of it, or the read was not asked for it (``read(progress=True)``).
    progress: Mapping[str, RankProgress] | None = None


class FleetRead:
    """Reads of the fleet through ``client``, with the memory of unsupported methods."""

    def __init__(self, client: FleetClient) -> None:
        self._client = client
        #: method → {engine: its handshake count when it said it has no such method}.
        self._unsupported: dict[str, dict[str, int]] = {}

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
    ) -> FleetReading:
        """Every method of ``methods`` the attach mode supports, on every engine (or on
        ``engines``: a paced poll's burst), all calls sharing one deadline. An engine known
        not to have a method is not asked; its outcome says so (``is_unsupported``). The
        details of every engine are read before (whom to ask, and whether it restarted) and
        once after the calls: the one read after a fan-out. ``progress``: each engine's
        progress too (the poll's; a gate decides without it)."""
        client = self._client
        before = {d.engine: d for d in client.engine_details()}
        self._forget_restarted(before)
        asked = [
            inv
            for inv in (*READS, *ON_DEMAND)  # an on-demand read only when asked for by name
            if inv.method in methods and inv.method in client.capabilities.methods
        ]
        wanted = set(before) if engines is None else set(engines) & set(before)
        calls, skipped = [], []
        for inv in asked:
            skip = self._unsupported.get(inv.method, {})
            skipped.append([e for e in before if e in skip and e in wanted])
            targets = (
                None
                if engines is None and not skip
                else [e for e in before if e in wanted and e not in skip]
            )
            calls.append(client.call_utility(inv.method, timeout_s=timeout_s, engines=targets))
        results: dict[str, list[EngineOutcome]] = {}
        for inv, outcomes, known in zip(asked, await asyncio.gather(*calls), skipped, strict=True):
            self._remember(inv.method, outcomes, before)
            said = [EngineOutcome(e, Outcome.FAILED, error=KNOWN_UNSUPPORTED) for e in known]
            results[inv.method] = require_type(inv, [*outcomes, *said])
        after = {d.engine: d for d in client.engine_details()}
        return FleetReading(
            results,
            tuple(before),
            {engine: after.get(engine, d) for engine, d in before.items()},
            tuple(client.engine_labels),
            progress_of(client.observations) if progress else None,
        )

    def _remember(
        self, method: str, outcomes: list[EngineOutcome], details: Mapping[str, EngineDetail]
    ) -> None:
        for o in outcomes:
            if is_unsupported(o) and o.engine in details:
                self._unsupported.setdefault(method, {})[o.engine] = details[o.engine].handshakes
                log.info("engine %s does not support %s: not asked again", o.engine, method)

    def _forget_restarted(self, details: Mapping[str, EngineDetail]) -> None:
        """An engine that handshook again may run another vLLM: ask it everything again."""
        for per_engine in self._unsupported.values():
            for engine, handshakes in list(per_engine.items()):
                detail = details.get(engine)
                if detail is None or detail.handshakes != handshakes:
                    del per_engine[engine]
