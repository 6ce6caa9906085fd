"""What an attach mode learns besides a call's answers, handed to the layers above through one
seam: ``Observations``, the board every ``FleetClient`` has.

A mode registers a *source* per kind of fact it can know (engines outside the expected set
that tried to join, each API server's elastic-EP operation, the client's own counters, ...);
the layers above read a kind's current observations (``of``), each a typed ``Observation``
(engine, what, value, when, source). A mode without a fact never registers its source, and
``of`` then says so (None: this mode cannot know), so a new fact is added by one source and
its consumers, never by a new member on every mode. Work a source needs once per poll (a read
off the poll's path) is registered as a refresher and started by ``refresh``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

from exporter.protocol.activity import RequestCounts
from exporter.protocol.elastic_ep import ElasticEpRead
from exporter.protocol.progress import RankProgress

#: Engines outside the expected set that tried to join: engine = the identity (hex), value an
#: ``UnexpectedEngine`` (owner and relay mode's handshake).
UNEXPECTED_ENGINE = "unexpected_engine"
#: Each API server's elastic-EP operation: engine = the target, value an ``ElasticEpRead``
#: (HTTP and in-process mode).
ELASTIC_EP_OPERATION = "elastic_ep_operation"
#: The client's own counters: engine None, value a ``ClientCounter`` (relayed handshakes,
#: state-file writes).
CLIENT_COUNT = "client_count"
#: Each rank's forward progress: engine = the label, value a ``RankProgress`` (in-process mode:
#: vLLM's stat loggers; HTTP mode: vLLM's per-engine token counters). Owner and relay mode
#: have no source: no request flows through them.
PROGRESS = "progress"
#: Each rank's running and waiting requests from a live source that follows the engine's
#: steps and holds everything the rank holds, so a poll takes its activity from them and need
#: not ask ``has_work``: engine = the label, value a ``RequestCounts`` (in-process: the DP
#: coordinator's table raised to the front end's own count). A rank left out: asked.
WORK_COUNTS = "work_counts"


@dataclass(frozen=True, slots=True)
class Observation:
    """One fact a mode observed: about ``engine`` (None: the fleet's or the client's own)."""

    engine: str | None
    what: str
    value: Any
    when: float
    source: str


@dataclass(frozen=True, slots=True)
class UnexpectedEngine:
    """An engine outside the expected set that tried to join: the DP rank its identity names
    (None: not a rank), how many handshakes it tried, when it was last seen (unix)."""

    dp_rank: int | None
    handshakes: int
    last_seen_unix: float


@dataclass(frozen=True, slots=True)
class ClientCounter:
    """One counter the client keeps of its own: the metric family it is published as, and its
    counts by the family's one label (empty: published, with no sample yet)."""

    family: str
    counts: tuple[tuple[str, int], ...]


#: A source: the current observations of one kind.
Source = Callable[[], Iterable[Observation]]
#: A source that reads only the engines asked for (None: every one): a paced poll's burst
#: asks for its own engines, and reading every engine for each burst costs n²/burst a poll.
ScopedSource = Callable[[Collection[str] | None], Iterable[Observation]]


class Observations:
    """The board: sources by kind, and the refreshers started once per poll."""

    def __init__(self) -> None:
        self._sources: dict[str, tuple[Source | ScopedSource, bool]] = {}
        self._refreshers: list[Callable[[float], None]] = []

    def add_source(self, what: str, source: Source | ScopedSource, *, scoped: bool = False) -> None:
        """``source`` tells the current observations of kind ``what`` (one source per kind);
        ``scoped``: it takes the engines asked for (``ScopedSource``)."""
        if what in self._sources:
            raise ValueError(f"a source of {what!r} is registered already")
        self._sources[what] = (source, scoped)

    def add_refresher(self, refresh: Callable[[float], None]) -> None:
        """``refresh(timeout_s)`` starts a source's read once per poll (never awaited)."""
        self._refreshers.append(refresh)

    def knows(self, what: str) -> bool:
        """Whether this mode can observe ``what`` at all."""
        return what in self._sources

    def of(
        self, what: str, engines: Collection[str] | None = None
    ) -> tuple[Observation, ...] | None:
        """The current observations of kind ``what`` (of ``engines`` only: the observations
        about another engine or none left out); None: this mode cannot know it."""
        entry = self._sources.get(what)
        if entry is None:
            return None
        source, scoped = entry
        if scoped:
            return tuple(cast("ScopedSource", source)(engines))
        found = cast("Source", source)()
        if engines is None:
            return tuple(found)
        wanted = set(engines)
        return tuple(o for o in found if o.engine in wanted)

    def refresh(self, timeout_s: float) -> None:
        for refresh in self._refreshers:
            refresh(timeout_s)


def observed(engine: str | None, what: str, value: Any, source: str) -> Observation:
    """An observation made now."""
    return Observation(engine, what, value, time.time(), source)


def client_counts(counters: Mapping[str, Mapping[str, int]], source: str) -> list[Observation]:
    """A client's counters (family → label → count) as observations, one per family."""
    now = time.time()
    return [
        Observation(None, CLIENT_COUNT, ClientCounter(family, tuple(counts.items())), now, source)
        for family, counts in counters.items()
    ]


def counters_of(board: Observations) -> dict[str, dict[str, int]]:
    """The client's counters back as family → label → count ({} for a mode without any)."""
    found: dict[str, dict[str, int]] = {}
    for o in board.of(CLIENT_COUNT) or ():
        counter: ClientCounter = o.value
        found[counter.family] = dict(counter.counts)
    return found


def elastic_ep_reads(board: Observations) -> tuple[ElasticEpRead, ...] | None:
    """Each API server's last elastic-EP read, in target order; None where the mode has no API
    server to ask (owner, relay)."""
    found = board.of(ELASTIC_EP_OPERATION)
    return None if found is None else tuple(o.value for o in found)


def unexpected_engines(board: Observations) -> dict[str, UnexpectedEngine]:
    """Engines outside the expected set that tried to join, by identity (newest last)."""
    return {o.engine or "": o.value for o in board.of(UNEXPECTED_ENGINE) or ()}


def work_counts(
    board: Observations, engines: Collection[str] | None = None
) -> dict[str, RequestCounts]:
    """Each rank's requests that tell its activity, by engine label ({}: none, or no source),
    of ``engines`` (None: every engine)."""
    found = board.of(WORK_COUNTS, engines) or ()
    return {o.engine: o.value for o in found if o.engine is not None}


def progress_of(
    board: Observations, engines: Collection[str] | None = None
) -> dict[str, RankProgress] | None:
    """Each rank's forward progress by engine label (a rank absent: unknown), of ``engines``
    (None: every engine); None where the mode has no source of it (owner, relay)."""
    found = board.of(PROGRESS, engines)
    if found is None:
        return None
    return {o.engine: o.value for o in found if o.engine is not None}
