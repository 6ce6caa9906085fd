"""Where a poll's answers come from: this process's own reads, or one leader's for a deployment.

vLLM runs one API server process per DP rank by default, each a client of every engine. When
each polled, every engine answered K times the same reads (K processes) and the fleet's work
grew as engines times processes. With ``PublishingRead`` in API server 0 and ``FollowerRead`` in
the others, one process asks: it publishes each poll's outcomes (``encode_reading``), the others
build their snapshots from them with their own engine details, so every process still answers
``/dp/status``, ``/dp/readyz`` and ``/dp/routable`` truthfully, and the gate's fresh fan-out
stays in whichever process is asked.

A follower never trusts what it cannot check: a reading that is missing, too old, unreadable
or not this deployment's is set aside and the follower reads the engines itself (and says so,
``describe``) until the leader's readings are fresh again. A lapsed leader costs the old price,
never a wrong answer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping
from typing import Any, Protocol

import msgspec

from exporter.client.fleet import EngineOutcome, FleetClient, Outcome
from exporter.client.observe import progress_of
from exporter.control.fleetread import ALL_METHODS, FleetRead, FleetReading
from exporter.fleetstate.invariants import READS, require_type

log = logging.getLogger("exporter.poller")

#: The reading file's format; another number is not believed.
READING_FORMAT = 1
#: Seconds a leader's clock may run ahead of a follower's before its reading is refused.
CLOCK_SKEW_S = 2.0
#: A follower warns at most this often that it reads the engines itself.
WARN_EVERY_S = 60.0
_INVARIANTS = {inv.method: inv for inv in READS}
#: An engine this process knows that the leader's reading does not name.
NOT_READ = "not in the leader's reading (it does not know this engine yet)"


class ReadingSource(Protocol):
    """What the poller reads each poll from (``FleetRead`` is one)."""

    async def read(
        self,
        methods: Collection[str],
        timeout_s: float,
        *,
        progress: bool = False,
        engines: Collection[str] | None = None,
        listen: float | None = None,
    ) -> FleetReading: ...

    def unsupported_by(self, engine: str) -> frozenset[str]: ...

    def unsupported_everywhere(self, method: str, engines: Collection[str]) -> bool: ...

    def describe(self) -> dict[str, Any]:
        """``/status``'s ``last_poll.source``: role, from, age_s, reason."""
        ...


def asks_engines(source: ReadingSource) -> bool:
    """Whether ``source`` asks the engines itself now (alone, the leader, or a follower that
    cannot believe the leader's reading): only then is a poll worth pacing; a follower that
    follows reads one file per poll, whole."""
    return bool(source.describe().get("from") == "self")


class PublishedReading(msgspec.Struct, frozen=True):
    """A leader's poll as published: its outcomes and what each engine said it lacks."""

    format: int
    written_unix: float
    api_server: int
    outcomes: dict[str, list[EngineOutcome]]
    unsupported: dict[str, list[str]]


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(PublishedReading)


class BadReading(ValueError):
    """A published reading this process cannot believe (the message says why)."""


def encode_reading(
    outcomes: Mapping[str, Mapping[str, EngineOutcome]],
    engines: Iterable[str],
    source: FleetRead,
    api_server: int,
    written_unix: float,
) -> bytes:
    """``outcomes`` (method → engine → its latest outcome) of ``engines`` as a reading."""
    engines = list(engines)
    unsupported = {m: [e for e in engines if m in source.unsupported_by(e)] for m in ALL_METHODS}
    return _encoder.encode(
        PublishedReading(
            READING_FORMAT,
            written_unix,
            api_server,
            {m: [by[e] for e in engines if e in by] for m, by in outcomes.items()},
            {m: listed for m, listed in unsupported.items() if listed},
        )
    )


def decode_reading(
    data: bytes, *, now_unix: float, max_age_s: float, leader: int = 0
) -> PublishedReading:
    """The reading in ``data`` when it is fresh and well formed; ``BadReading`` otherwise.
    Every value is checked again against its invariant's type (a hostile file names no state
    the engines never answered: it fails the check and reads failed)."""
    try:
        published = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadReading(f"not a reading: {exc}") from None
    if published.format != READING_FORMAT:
        raise BadReading(f"format {published.format}, not {READING_FORMAT}")
    if published.api_server != leader:
        raise BadReading(f"written by API server {published.api_server}, not {leader}")
    age = now_unix - published.written_unix
    if not math.isfinite(age) or age < -CLOCK_SKEW_S:
        raise BadReading("written in the future")
    if age > max_age_s:
        raise BadReading(f"{age:.1f} s old (believed up to {max_age_s:g} s)")
    unknown = set(published.outcomes) - ALL_METHODS
    if unknown:
        raise BadReading(f"methods this exporter does not read: {sorted(unknown)[:3]}")
    return published


class PublishingRead:
    """The leader's source: its own ``FleetRead``; after each read (a poll, or a paced poll's
    burst) every engine's latest outcomes handed to ``publish`` (bytes: a file write off the
    loop)."""

    def __init__(
        self,
        reader: FleetRead,
        publish: Callable[[bytes], Awaitable[None]],
        api_server: int = 0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._reader = reader
        self._publish = publish
        self._api_server = api_server
        self._wall = wall_clock
        self.published = 0
        #: Method → engine → its latest outcome (a paced poll reads a burst at a time).
        self._latest: dict[str, dict[str, EngineOutcome]] = {}

    async def read(
        self,
        methods: Collection[str],
        timeout_s: float,
        *,
        progress: bool = False,
        engines: Collection[str] | None = None,
        listen: float | None = None,
    ) -> FleetReading:
        reading = await self._reader.read(
            methods, timeout_s, progress=progress, engines=engines, listen=listen
        )
        known = set(reading.engines)
        for method, outcomes in reading.outcomes.items():
            latest = self._latest.setdefault(method, {})
            latest.update((o.engine, o) for o in outcomes)
            for gone in [e for e in latest if e not in known]:
                del latest[gone]
        if engines is not None and not progress:
            # A paced poll's earlier burst: published with its last one (the read that also
            # takes the progress), so the file is written once a poll, not once a burst.
            return reading
        data = encode_reading(
            self._latest, reading.engines, self._reader, self._api_server, self._wall()
        )
        try:
            await self._publish(data)
            self.published += 1
        except OSError as exc:  # the followers read the engines themselves meanwhile
            log.warning("cannot publish this poll's reading: %s", exc)
        return reading

    def unsupported_by(self, engine: str) -> frozenset[str]:
        return self._reader.unsupported_by(engine)

    def unsupported_everywhere(self, method: str, engines: Collection[str]) -> bool:
        return self._reader.unsupported_everywhere(method, engines)

    def describe(self) -> dict[str, Any]:
        return {"role": "leader", "from": "self", "age_s": None, "reason": None}


class FollowerRead:
    """A follower's source: the leader's last reading when fresh, else its own ``FleetRead``."""

    def __init__(
        self,
        reader: FleetRead,
        client: FleetClient,
        load: Callable[[], Awaitable[bytes | None]],
        *,
        max_age_s: float,
        leader: int = 0,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._client = client
        self._load = load
        self.max_age_s = max_age_s
        self._leader = leader
        self._wall = wall_clock
        self._clock = clock
        self._unsupported: Mapping[str, frozenset[str]] = {}
        self._own = True
        self._age_s: float | None = None
        self._reason: str | None = "no reading yet"
        self._warned_at = -math.inf
        #: Polls built from the leader's reading, and polls this process read itself.
        self.followed = 0
        self.own_reads = 0

    async def read(
        self,
        methods: Collection[str],
        timeout_s: float,
        *,
        progress: bool = False,
        engines: Collection[str] | None = None,
        listen: float | None = None,
    ) -> FleetReading:
        try:
            data = await self._load()
            if data is None:
                raise BadReading(f"API server {self._leader} has published no reading")
            published = decode_reading(
                data, now_unix=self._wall(), max_age_s=self.max_age_s, leader=self._leader
            )
        except (BadReading, OSError) as exc:
            return await self._read_own(methods, timeout_s, progress, engines, listen, str(exc))
        self.followed += 1
        self._own, self._reason = False, None
        self._age_s = max(0.0, self._wall() - published.written_unix)
        return self._from(published, methods, progress, engines)

    async def _read_own(
        self,
        methods: Collection[str],
        timeout_s: float,
        progress: bool,
        engines: Collection[str] | None,
        listen: float | None,
        reason: str,
    ) -> FleetReading:
        self.own_reads += 1
        self._own, self._reason, self._age_s = True, reason, None
        now = self._clock()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "API server %d's reading is not usable (%s): this process reads the engines",
                self._leader,
                reason,
            )
        return await self._reader.read(
            methods, timeout_s, progress=progress, engines=engines, listen=listen
        )

    def _from(
        self,
        published: PublishedReading,
        methods: Collection[str],
        progress: bool,
        engines: Collection[str] | None,
    ) -> FleetReading:
        """The leader's outcomes for the engines this process knows (or ``engines`` of them),
        in its order; an engine the leader did not read is failed (never a value this process
        did not see)."""
        details = {d.engine: d for d in self._client.engine_details()}
        wanted = [e for e in details if engines is None or e in engines]
        outcomes: dict[str, list[EngineOutcome]] = {}
        for method, published_outcomes in published.outcomes.items():
            if method not in methods:
                continue
            ours = [o for o in published_outcomes if o.engine in details]
            seen = {o.engine: o for o in require_type(_INVARIANTS[method], ours)}
            outcomes[method] = [
                seen.get(e) or EngineOutcome(e, Outcome.FAILED, error=NOT_READ) for e in wanted
            ]
        self._unsupported = {m: frozenset(engines) for m, engines in published.unsupported.items()}
        return FleetReading(
            outcomes,
            tuple(details),
            details,
            tuple(self._client.engine_labels),
            progress_of(self._client.observations) if progress else None,
        )

    def unsupported_by(self, engine: str) -> frozenset[str]:
        if self._own:
            return self._reader.unsupported_by(engine)
        return frozenset(m for m, engines in self._unsupported.items() if engine in engines)

    def unsupported_everywhere(self, method: str, engines: Collection[str]) -> bool:
        if self._own:
            return self._reader.unsupported_everywhere(method, engines)
        return bool(engines) and self._unsupported.get(method, frozenset()) >= set(engines)

    def describe(self) -> dict[str, Any]:
        return {
            "role": "follower",
            "from": "self" if self._own else f"api_server_{self._leader}",
            "age_s": None if self._age_s is None else round(self._age_s, 3),
            "reason": self._reason,
        }
