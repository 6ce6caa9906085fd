"""The one adapter to vLLM's own engine-core client (in-process mode's only private names).

vLLM's API server and ``AsyncLLM`` hold an engine-core client (``AsyncMPClient``,
``DPAsyncMPClient``, ``DPLBAsyncMPClient``) that is already connected to every DP engine. vLLM
0.32 and 0.33 both offer, on that object:

* ``core_engines``: the engines' ZMQ identities, 2 bytes little-endian of the DP rank (read
  afresh on every call: elastic EP changes the list);
* ``_call_utility_async(method, *args, engine=identity)``: one utility call to one engine, no
  timeout of its own; its future sits in ``utility_results`` until the reply comes;
* ``resources.engine_dead``: set once the engine-core client saw an engine die;
* ``get_kv_event_sources()``: each ready engine's KV-events publisher config, keyed by DP rank,
  as its registration carried it (optional here: ``{}`` without it);
* ``_engine_status`` (vLLM 0.33, optional): the front end's copy of the fault-tolerance
  sentinels' pushes, DP rank → ``{"id", "status", "fault_info"?}`` (``{}`` with fault tolerance
  off); what ``GET /fault_tolerance/status`` answers;
* ``get_external_elastic_ep_status()`` (vLLM 0.33, optional; on the ``AsyncLLM``, else on this
  client): the external elastic-EP operation's status map (None without external elastic EP);
* ``lb_engines`` with ``engine_ranks_managed`` (optional): the DP coordinator's last published
  ``[waiting, running, kv_cache_usage]`` of each managed rank, what vLLM's front end routes by.
  Only live while the front end's subscription to the coordinator runs
  (``resources.stats_update_task``; vLLM's internal load balancing): otherwise the table stays
  at its initial zeros or its last publication, so it is not read at all (unknown, never idle);
* ``engine_inflight`` (``DPLBAsyncMPClient``, optional): this front end's unfinished requests
  per engine identity, what vLLM's router scores by beside the table. Read whatever the
  table's state: a floor of each rank's counts; a rank whose count cannot be read is unknown,
  never 0 (``own_unfinished``).

Everything else of vLLM stays out of the exporter: this module imports nothing from vLLM (the
caller passes ``vllm.__version__`` and the sleep-mode flag), and ``check_core`` says, in one
line, which of these names a vLLM release lacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from exporter.error import ConfigError, ProtocolError
from exporter.protocol.activity import RequestCounts, read_count, read_lb_entry
from exporter.protocol.kv_events import KvEventsSource, parse_kv_events_config
from exporter.protocol.pushes import (
    RankStatus,
    entry_rank,
    read_rank_status,
    unreadable,
)

log = logging.getLogger("exporter.inprocess")

#: What in-process mode needs of vLLM's engine-core client (vLLM 0.32 and 0.33 have all of it).
REQUIRED_NAMES = ("core_engines", "_call_utility_async", "utility_results", "resources")
#: The class name of vLLM's ``vllm.v1.engine.exceptions.EngineDeadError`` (not imported).
ENGINE_DEAD_ERROR = "EngineDeadError"
#: What in-process mode reads of each of vLLM's ``KVEventsConfig`` objects.
KV_EVENTS_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "topic")
#: DP ranks read from ``get_kv_event_sources`` at most (vLLM's ranks fit in two bytes).
MAX_KV_EVENT_SOURCES = 0x10000
ENGINE_STATUS = "_engine_status"
ELASTIC_EP_STATUS = "get_external_elastic_ep_status"


def engine_core_of(engine_client: Any) -> Any:
    """The engine-core client of an ``EngineClient`` (the API server's ``AsyncLLM``, or a
    trainer's), with the names in-process mode needs checked."""
    core = getattr(engine_client, "engine_core", None)
    if core is None:
        raise ConfigError(
            f"in-process mode: {type(engine_client).__name__} has no engine_core (expected "
            "vLLM's AsyncLLM, vLLM 0.32 or later)"
        )
    check_core(core)
    return core


def check_core(core: Any) -> None:
    """``ConfigError`` naming what is missing when ``core`` is not an engine-core client this
    mode can use (an in-process ``InprocClient``, a vLLM release that renamed the names)."""
    missing = [name for name in REQUIRED_NAMES if not hasattr(core, name)]
    if missing:
        raise ConfigError(
            f"in-process mode: vLLM's engine-core client {type(core).__name__} lacks "
            f"{', '.join(missing)} (supported: vLLM 0.32 and 0.33 with multiprocess engines; "
            "use owner, relay or HTTP mode with this vLLM)"
        )
    if not hasattr(core.resources, "engine_dead"):
        raise ConfigError(
            f"in-process mode: vLLM's engine-core client {type(core).__name__} lacks "
            "resources.engine_dead (supported: vLLM 0.32 and 0.33)"
        )


def rank_of(identity: bytes) -> int:
    """A DP engine's rank from its ZMQ identity (2 bytes, little-endian)."""
    return int.from_bytes(identity, "little")


def is_engine_dead_error(exc: BaseException) -> bool:
    return any(cls.__name__ == ENGINE_DEAD_ERROR for cls in type(exc).__mro__)


@dataclass
class VllmCore:
    """vLLM's engine-core client as the in-process fleet uses it."""

    core: Any = field(repr=False)
    vllm_version: str | None = None
    enable_sleep_mode: bool | None = None
    #: The ``AsyncLLM`` that owns ``core``: what it records beside an engine call is kept in
    #: step (``after_fleet_call``). None: nothing to keep (a bare engine-core client).
    front_end: Any = field(default=None, repr=False)
    #: vLLM's process-local elastic-EP flag (``get_scaling_elastic_ep`` of its API server's
    #: middleware), found by the caller: what vLLM's route answers without external elastic
    #: EP (``elastic_ep_status``). None: not in this process (never scaling here).
    scaling_flag: Callable[[], Any] | None = field(default=None, repr=False)

    #: The last ``core_engines`` seen and what was made of it (``engines``, ``_fleet``).
    _fleet_of: _Fleet = field(
        default_factory=lambda: _Fleet((), [], {}, {}), init=False, repr=False
    )
    #: The last ``engine_ranks_managed`` seen, and each rank's position in it.
    _managed_of: tuple[tuple[Any, ...], dict[int, int]] = field(
        default=((), {}), init=False, repr=False
    )
    #: DP rank → (vLLM's config object, what it was read as) (``kv_event_sources``).
    _kv_read: dict[int, tuple[Any, KvEventsSource | None]] = field(
        default_factory=dict, init=False, repr=False
    )

    #: The last ``get_kv_event_sources`` items and what ``kv_event_sources`` made of them.
    _kv_items: list[tuple[Any, Any]] = field(default_factory=list, init=False, repr=False)
    _kv_found: dict[str, KvEventsSource] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        check_core(self.core)

    def engines(self) -> list[tuple[str, bytes]]:
        """(label, identity) of every engine this client manages, in rank order: read afresh
        on every call (elastic EP changes the list), built again only when it changed (a
        poll at 256 engines asks it once per fan-out; on vLLM's loop)."""
        return self._fleet().engines

    def identity_of(self) -> dict[str, bytes]:
        """Engine label → its identity (as ``engines``; do not modify)."""
        return self._fleet().identity_of

    def _fleet(self) -> _Fleet:
        """What ``core_engines`` is now (compared whole in C, rebuilt only when it changed)."""
        identities = tuple(self.core.core_engines)
        fleet = self._fleet_of
        if identities != fleet.identities:
            engines = sorted(((str(rank_of(i)), bytes(i)) for i in identities), key=_rank_key)
            positions = {rank_of(i): (position, i) for position, i in enumerate(identities)}
            fleet = self._fleet_of = _Fleet(identities, engines, dict(engines), positions)
        return fleet

    def dead(self) -> bool:
        return bool(self.core.resources.engine_dead)

    @property
    def client_index(self) -> int:
        return int(getattr(self.core, "client_index", 0))

    def kv_event_sources(self) -> dict[str, KvEventsSource]:
        """Engine label → its KV-events publisher, from vLLM's own record of the engines'
        registrations (``get_kv_event_sources``, vLLM 0.32 and 0.33). vLLM does not keep the
        address each engine connected from, so a wildcard host stays unresolved (the source's
        ``note`` says so); ``tcp://*:0`` is reported by vLLM with the node's IP."""
        getter = getattr(self.core, "get_kv_event_sources", None)
        if getter is None:
            return {}
        try:
            items = list(getter().items())[:MAX_KV_EVENT_SOURCES]
            # The same configs as last time (compared in C; a config's own __eq__ may raise).
            unchanged = items == self._kv_items
        except Exception:  # another vLLM's shape: nothing to report, never an error in vLLM
            log.debug("get_kv_event_sources() failed", exc_info=True)
            return {}
        if unchanged:
            return dict(self._kv_found)
        found = {}
        read: dict[int, tuple[Any, KvEventsSource | None]] = {}
        for rank, config in items:
            if type(rank) is not int:
                continue
            kept = self._kv_read.get(rank)
            # vLLM keeps each engine's config object from its registration: read once.
            source = kept[1] if kept is not None and kept[0] is config else _kv_source(rank, config)
            read[rank] = (config, source)
            if source is not None:
                found[str(rank)] = source
        self._kv_read = read
        self._kv_items, self._kv_found = items, dict(found)
        return found

    def keeps_fault_status(self) -> bool:
        """Whether this vLLM's front end keeps its engines' fault-tolerance status."""
        return isinstance(getattr(self.core, ENGINE_STATUS, None), dict)

    def fault_statuses(self, ranks: Sequence[int]) -> dict[int, RankStatus] | None:
        """Rank → its status in ``_engine_status``, for ``ranks`` only (the ranks this client
        manages: any engine can add entries to the table, keyed by the index its push carries,
        so it is never copied or walked whole on vLLM's loop). Each entry read by the one rule
        (``read_rank_status``: unreadable is ``unknown`` with its ``problem``; an entry naming
        another rank than its key is unreadable too). A managed rank without an entry has no
        status. None: this front end keeps no table."""
        table = getattr(self.core, ENGINE_STATUS, None)
        if not isinstance(table, dict):
            return None
        found = {}
        for rank in ranks:
            try:
                entry = table.get(rank)
            except Exception:  # a table of another kind: nothing readable, never an error in vLLM
                return None
            if entry is None:
                continue
            named = entry_rank(entry)
            if named is not None and named != rank:
                found[rank] = unreadable(rank, f"names engine {named}")
            else:
                found[rank] = read_rank_status(entry, rank)
        return found

    def request_counts(
        self, ranks: Sequence[int], own_counts: Mapping[int, int | None] | None = None
    ) -> dict[int, RequestCounts]:
        """Rank → its running and waiting requests, for ``ranks`` only: the coordinator's
        counts from the front end's load-balancing table (``lb_engines``) where it is live and
        the rank's entry reads, each raised to the front end's own unfinished requests on that
        rank (``own_unfinished``; ``own_counts``: as the caller read it just now); where the
        table is dead, missing, not a list or the entry unreadable, the own count alone when
        above 0 (a floor: vLLM's router keeps scoring by it). A rank with neither is left out:
        unknown, never idle."""
        table = self._coordinator_counts(ranks)
        held = (self.own_unfinished(ranks) if own_counts is None else own_counts) or {}
        found = {}
        for rank in ranks:
            counts, own = table.get(rank), held.get(rank)
            if counts is not None:
                found[rank] = with_in_flight_floor(counts, own)
            elif own:
                found[rank] = RequestCounts(own, 0)
        return found

    def _coordinator_counts(self, ranks: Sequence[int]) -> dict[int, RequestCounts]:
        """Rank → the coordinator's counts in ``lb_engines``, each entry read by the one rule;
        empty while the front end's subscription to the coordinator is not running (the table
        then holds what it held last, or its initial zeros) or the table is not vLLM's.
        Whatever vLLM's objects hold, nothing raises on its loop."""
        core = self.core
        try:
            task = getattr(core.resources, "stats_update_task", None)
            if task is None or (callable(getattr(task, "done", None)) and task.done()):
                return {}
            table = getattr(core, "lb_engines", None)
            managed = getattr(core, "engine_ranks_managed", None)
            if not isinstance(table, list) or not isinstance(managed, list):
                return {}
            order = tuple(managed)
            seen, position_of = self._managed_of
            if order != seen:  # compared in C: rebuilt only when vLLM's list changed
                position_of = {r: p for p, r in enumerate(order) if type(r) is int}
                self._managed_of = (order, position_of)
            found = {}
            for rank in ranks:  # the ranks asked for only (a paced poll's burst)
                position = position_of.get(rank)
                if position is not None and position < len(table):
                    counts = read_lb_entry(table[position])
                    if counts is not None:
                        found[rank] = counts
            return found
        except Exception:  # a table of another kind: no counts, never an error in vLLM
            log.debug("lb_engines unreadable", exc_info=True)
            return {}

    def own_unfinished(self, ranks: Sequence[int]) -> dict[int, int | None] | None:
        """Rank → this front end's unfinished requests on it (``engine_inflight``: vLLM
        0.30-0.33's ``DPLBAsyncMPClient`` keeps a ``Counter`` by engine identity, "exact
        per-engine count of this client's unfinished requests"; a list in ``core_engines``'
        order is read by position), for ``ranks`` only, whatever the coordinator's table
        says. None for a rank whose count cannot be read (negative, huge, not a whole number,
        a look-up that raises, a list of another length): unknown, never 0. None as a whole
        when this front end keeps no such count (vLLM's other clients: DP 1, external load
        balancing)."""
        inflight = getattr(self.core, "engine_inflight", None)
        if inflight is None:
            return None
        held: dict[int, int | None] = {}
        try:
            fleet = self._fleet()
        except Exception:  # engines() fails the same way: nothing to say of any rank
            return dict.fromkeys(ranks)
        by_position = isinstance(inflight, (list, tuple))
        try:
            whole = by_position and len(inflight) == len(fleet.identities)
        except Exception:  # a list of another kind: no rank's count is known
            whole = by_position = False
        by_identity = not by_position and isinstance(inflight, Mapping)
        for rank in ranks:  # the ranks asked for only (a paced poll's burst)
            place = fleet.position_of.get(rank)
            if place is None:
                continue
            held[rank] = None
            try:
                if whole:
                    held[rank] = read_count(inflight[place[0]])
                elif by_identity:
                    held[rank] = read_count(inflight.get(place[1], 0))
            except Exception:  # a look-up that raises: that rank's count is not known
                continue
        return held

    def elastic_ep_status(self) -> Callable[[], Awaitable[Any]] | None:
        """``get_external_elastic_ep_status`` of the ``AsyncLLM`` (vLLM 0.33; of the
        engine-core client without one): the external elastic-EP operation's status map, or
        None without external elastic EP. None here: this vLLM has no such method."""
        for owner in (self.front_end, self.core):
            method = getattr(owner, ELASTIC_EP_STATUS, None) if owner is not None else None
            if callable(method):
                return cast("Callable[[], Awaitable[Any]]", method)
        return None

    def call(self, method: str, args: tuple[Any, ...], identity: bytes) -> Awaitable[Any]:
        """vLLM's own call of ``method`` on one engine: its coroutine as vLLM made it, run as
        a task by the caller (one frame fewer per call than awaiting it in one of ours). What
        is not a coroutine is awaited in one of ours, and a call that raises at once fails
        when awaited: as a coroutine of vLLM's would, never in the caller."""
        try:
            call = self.core._call_utility_async(method, *args, engine=identity)
        except Exception as exc:
            return _raised(exc)
        return call if asyncio.iscoroutine(call) else _awaited(call)

    async def after_fleet_call(self, method: str, args: tuple[Any, ...], values: list[Any]) -> None:
        """What ``AsyncLLM`` does beside the same call to every engine, done once every engine
        confirmed it (vLLM 0.32, 0.33: ``AsyncLLM.sleep``, ``wake_up``, ``pause_generation``):
        the front end's multimodal cache cleared, and the sleep state its own
        ``vllm:engine_sleep_state`` reports recorded, so vLLM's series do not go stale."""
        llm = self.front_end
        if llm is None:
            return
        logger_manager: Any = getattr(llm, "logger_manager", None)
        renderer: Any = getattr(llm, "renderer", None)
        clears_cache = (method == "sleep" and (args[0] if args else 1) >= 1) or (
            method == "pause_scheduler" and (args[1] if len(args) > 1 else True)
        )
        if clears_cache and hasattr(renderer, "clear_mm_cache_async"):
            await renderer.clear_mm_cache_async()
        if hasattr(logger_manager, "record_sleep_state"):
            if method == "sleep":
                logger_manager.record_sleep_state(1, args[0] if args else 1)
            elif method == "wake_up" and all(v is True for v in values):
                logger_manager.record_sleep_state(0, 0)


def _kv_source(rank: int, config: Any) -> KvEventsSource | None:
    """One engine's registered ``KVEventsConfig`` (or a mapping of its fields) as a source;
    None when it publishes nothing or its config cannot be read."""
    fields = (
        config
        if isinstance(config, Mapping) or config is None
        else {name: getattr(config, name, None) for name in KV_EVENTS_FIELDS}
    )
    try:
        return parse_kv_events_config(fields)
    except ProtocolError as exc:
        log.debug("engine %d kv_events_config: %s", rank, exc)
        return None


@dataclass(frozen=True)
class _Fleet:
    """One ``core_engines`` list and what the reads make of it."""

    identities: tuple[Any, ...]
    #: (label, identity) in rank order.
    engines: list[tuple[str, bytes]]
    identity_of: dict[str, bytes]
    #: Rank → its position in ``core_engines`` and its identity as vLLM keeps it.
    position_of: dict[int, tuple[int, Any]]


async def _raised(exc: Exception) -> Any:
    raise exc


async def _awaited(call: Any) -> Any:
    return await call


def _rank_key(entry: tuple[str, bytes]) -> int:
    return int(entry[0])


def with_in_flight_floor(counts: RequestCounts, held: int | None) -> RequestCounts:
    """The coordinator's counts, raised to this front end's own unfinished requests on that
    rank (as vLLM's load balancer scores an engine: the greater of the two). The coordinator's
    snapshot can lag, and a scheduler paused with mode ``keep`` reports none of the requests it
    holds (vLLM 0.32: ``get_num_unfinished_requests`` is 0 under ``PAUSED_ALL``), so only this
    floor keeps such a rank from reading drained. The requests above the snapshot are counted
    as running: they were sent to that engine and have not finished."""
    if held is None or held <= counts.total:
        return counts
    return RequestCounts(counts.running + held - counts.total, counts.waiting)
