"""Utility calls over the engine-core protocol: call ids, futures, timeouts and fan-out.

``EngineCoreClient`` is the ``FleetClient`` of owner and relay mode. It builds its transport
itself, from a factory that receives the client as the transport's listener, so wiring goes one
way and there is never a half-built client or transport.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

from exporter.base.faults import ProtocolErrorTally
from exporter.base.tasks import watch
from exporter.client.enginecore.events import LinkSnapshot, TransportListener, UnexpectedEngines
from exporter.client.enginecore.late import LATE_REPLIES, LateReplies
from exporter.client.fleet import (
    DEFAULT_ALLOWED_METHODS,
    SHUTTING_DOWN,
    Capabilities,
    ChangeCallback,
    EngineDetail,
    EngineOutcome,
    Outcome,
    check_allowed,
    stopping,
    timed_out,
)
from exporter.client.observe import (
    CLIENT_COUNT,
    UNEXPECTED_ENGINE,
    Observation,
    Observations,
    client_counts,
)
from exporter.client.pushes import PushBook
from exporter.error import EngineUnavailable, StartupError
from exporter.protocol import UINT64_MAX, EngineOutput, encode_utility_request
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FaultStatus

log = logging.getLogger("exporter.client")

#: How long an engine whose ENGINE_CORE_DEAD came from an unknown connection gets to prove it
#: is alive by answering ``is_sleeping`` before it is given up.
DEATH_CONFIRM_TIMEOUT_S = 2.0


class ZmqTransport(Protocol):
    """What ``EngineCoreClient`` needs from a ZMQ transport (owner or relay)."""

    @property
    def engine_indices(self) -> list[int]: ...

    def link_snapshots(self) -> list[LinkSnapshot]: ...

    def connected_count(self) -> int: ...

    def client_index(self, engine_index: int) -> int: ...

    def send_utility(self, engine_index: int, payload: bytes) -> None: ...

    def confirm_dead(self, engine_index: int) -> None: ...

    def keep_fault_status(self, engine_index: int, status: FaultStatus | None) -> None: ...

    def counters(self) -> dict[str, Counter[str]]: ...

    def request_counts(self) -> Mapping[int, RequestCounts]: ...

    @property
    def unexpected(self) -> UnexpectedEngines: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


TransportFactory = Callable[[TransportListener], ZmqTransport]


class _FanOut:
    """The outcomes of one fan-out, and one future set when the last engine answered: a
    fan-out over N engines costs one future and one timer, not N."""

    __slots__ = ("done", "remaining", "results")

    def __init__(self, loop: asyncio.AbstractEventLoop, expected: int) -> None:
        self.done: asyncio.Future[None] = loop.create_future()
        # Every engine counts from the start: an engine refused at send time resolves its own
        # outcome without completing the fan-out for the engines not sent to yet.
        self.remaining = expected
        self.results: dict[int, EngineOutcome] = {}

    def resolve(self, engine_index: int, outcome: EngineOutcome) -> None:
        if engine_index in self.results:
            return
        self.results[engine_index] = outcome
        self.remaining -= 1
        if self.remaining <= 0 and not self.done.done():
            self.done.set_result(None)


@dataclass(slots=True)
class _Pending:
    engine_index: int
    fanout: _FanOut
    sent_at: float


class EngineCoreClient:
    """Fans utility calls out to every engine of a ZMQ transport and matches replies by id.

    It is the transport's listener: replies, deaths and restarts arrive as callbacks.
    """

    def __init__(
        self,
        make_transport: TransportFactory,
        faults: ProtocolErrorTally,
        *,
        on_change: ChangeCallback | None = None,
        on_status: ChangeCallback | None = None,
        allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS,
        death_confirm_timeout_s: float = DEATH_CONFIRM_TIMEOUT_S,
        beside_a_front_end: bool = False,
    ) -> None:
        self._faults = faults
        #: Owner mode: the exporter is client 0, the one engines push their status to; relay
        #: mode: a front end is (and owns the engines).
        self.capabilities = Capabilities(
            fault_status=not beside_a_front_end,
            beside_a_front_end=beside_a_front_end,
            handshakes=True,
            request_counts=beside_a_front_end,  # the DP coordinator's, as the front end's
            methods=allowed_methods,
        )
        self._allowed = allowed_methods
        self._on_change = on_change
        #: What an engine pushed changed: published without asking any engine anything.
        self._on_status = on_status
        self._death_confirm_timeout_s = death_confirm_timeout_s
        self._pending: dict[int, _Pending] = {}
        #: The calls that timed out: a reply to one is late, never unknown (``late``).
        self.late = LateReplies()
        self._labels: dict[int, str] = {}
        self._confirming: dict[int, asyncio.Task[None]] = {}
        self._closed = False
        # Random start: a restarted exporter does not reuse the ids its predecessor had in flight.
        self._next_id = random.getrandbits(64)
        #: What engines pushed unasked (the exporter is client 0 in owner mode).
        self.pushes = PushBook(faults)
        self.transport = make_transport(self)
        #: What the handshake learns besides the calls: strangers that tried to join, and
        #: the transport's own counters (relayed handshakes, state-file writes).
        self.observations = Observations()
        self.observations.add_source(UNEXPECTED_ENGINE, self._unexpected)
        self.observations.add_source(
            CLIENT_COUNT,
            lambda: client_counts(
                {**self.transport.counters(), LATE_REPLIES: self._late_counts()}, "transport"
            ),
        )

    # -- FleetClient -----------------------------------------------------------------------

    @property
    def engine_labels(self) -> list[str]:
        return [str(i) for i in self.transport.engine_indices]

    def engine_details(self) -> list[EngineDetail]:
        details = []
        counts = self.transport.request_counts()
        for link in self.transport.link_snapshots():
            reg = link.registration
            label = self._label(link.engine_index)
            details.append(
                EngineDetail(
                    engine=label,
                    connected=link.connected,
                    address=link.output_address,
                    vllm_version=reg.vllm_version if reg else None,
                    enable_sleep_mode=reg.enable_sleep_mode if reg else None,
                    handshakes=link.handshakes,
                    kv_events=reg.kv_events if reg else None,
                    registration=reg.facts if reg else (),
                    fault_status=self.pushes.fault_status.get(label),
                    membership=self.pushes.membership.get(label),
                    pushes=tuple(sorted(self.pushes.counts_of(label).items())),
                    requests=counts.get(link.engine_index),
                )
            )
        return details

    def _unexpected(self) -> list[Observation]:
        return [
            Observation(identity, UNEXPECTED_ENGINE, seen, seen.last_seen_unix, "handshake")
            for identity, seen in self.transport.unexpected.seen.items()
        ]

    async def start(self) -> None:
        self._closed = False
        try:
            await self.transport.start()
        except zmq.ZMQError as exc:
            raise StartupError(
                f"cannot open the engine-facing sockets: {exc} (see --handshake-address, "
                "--advertise-host, --bind-host, --fixed-base-port)"
            ) from None
        if self.capabilities.fault_status:  # statuses a previous exporter process recorded
            for link in self.transport.link_snapshots():
                if link.fault_status is not None:
                    self.pushes.restore(self._label(link.engine_index), link.fault_status)

    async def close(self) -> None:
        """End every call in flight (``stopping``: no reply will be read) and send nothing
        more; then close the transport."""
        self._closed = True
        for task in self._confirming.values():
            task.cancel()
        self._confirming.clear()
        for pending in self._pending.values():
            pending.fanout.resolve(
                pending.engine_index, stopping(self._label(pending.engine_index))
            )
        self._pending.clear()
        await self.transport.close()

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def _label(self, engine_index: int) -> str:
        label = self._labels.get(engine_index)
        if label is None:
            label = self._labels[engine_index] = str(engine_index)
        return label

    def _disconnected(self, engine_index: int, error: str) -> EngineOutcome:
        return EngineOutcome(self._label(engine_index), Outcome.DISCONNECTED, error=error)

    def _late_counts(self) -> dict[str, int]:
        """Each engine's late replies, 0 for every engine known (a series starts at 0)."""
        return {**dict.fromkeys(self.engine_labels, 0), **self.late.counts}

    def _allocate_id(self) -> int:
        call_id = self._next_id
        self._next_id = (call_id + 1) & UINT64_MAX
        return call_id

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        """Call ``method`` on every engine (or the ``engines`` labelled so) at once; one
        outcome per engine called, in engine order.

        Engines that are not connected get DISCONNECTED without a send; every other engine
        gets the shared deadline ``timeout_s``, so a hung engine delays nothing beyond it.
        """
        check_allowed(method, self._allowed)
        transport = self.transport
        indices = transport.engine_indices
        if engines is not None:
            wanted = set(engines)
            indices = [i for i in indices if self._label(i) in wanted]
        if self._closed:
            return [stopping(self._label(i)) for i in indices]
        fanout = _FanOut(asyncio.get_running_loop(), len(indices))
        results = fanout.results
        sent: list[int] = []
        try:
            for idx in indices:
                try:
                    slot = transport.client_index(idx)
                except EngineUnavailable as exc:
                    fanout.resolve(idx, self._disconnected(idx, str(exc)))
                    continue
                call_id = self._allocate_id()
                try:
                    payload = encode_utility_request(slot, call_id, method, args)
                except ValueError as exc:  # a client_index no engine can have: never sent
                    fanout.resolve(idx, self._disconnected(idx, str(exc)))
                    continue
                self._pending[call_id] = _Pending(idx, fanout, time.perf_counter())
                sent.append(call_id)
                try:
                    transport.send_utility(idx, payload)
                except EngineUnavailable as exc:
                    del self._pending[call_id]
                    fanout.resolve(idx, self._disconnected(idx, str(exc)))
            if fanout.remaining > 0:
                await asyncio.wait((fanout.done,), timeout=timeout_s)
            for idx in indices:
                if idx not in results:
                    results[idx] = timed_out(self._label(idx), timeout_s)
        finally:
            for call_id in sent:
                given_up = self._pending.pop(call_id, None)
                if given_up is not None:
                    self.late.give_up(call_id, given_up.engine_index)
            if not fanout.done.done():
                fanout.done.cancel()
        return [results[idx] for idx in indices]

    # -- TransportListener -----------------------------------------------------------------

    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        reply = output.utility
        if reply is None:
            if not output.notice:  # a notice (vLLM PR #51433's notifications) is no error
                self._faults.record(
                    "non_utility_output", f"engine {engine_index}: not a utility reply"
                )
            return False
        if reply.call_id < 0:  # vLLM's reserved ids: a push, never a reply to us
            value = reply.value if reply.failure_message is None else None
            label = self._label(engine_index)
            if self.pushes.on_push(label, engine_index, reply.call_id, value):
                self.transport.keep_fault_status(engine_index, self.pushes.fault_status.get(label))
                if self._on_status is not None:  # published at once; no engine is asked
                    self._on_status()
            return True
        pending = self._pending.get(reply.call_id)
        if pending is None:
            if self.late.claim(reply.call_id, engine_index, self._label(engine_index)):
                return True
            self._faults.record(
                "unknown_call_id", f"engine {engine_index}: reply to unknown call {reply.call_id}"
            )
            return False
        if pending.engine_index != engine_index:
            self._faults.record(
                "wrong_engine",
                f"engine {engine_index} answered call {reply.call_id} sent to "
                f"engine {pending.engine_index}",
            )
            return False
        del self._pending[reply.call_id]
        duration = time.perf_counter() - pending.sent_at
        label = self._label(engine_index)
        if reply.failure_message is None:
            outcome = EngineOutcome(label, Outcome.OK, reply.value, duration_s=duration)
        else:
            outcome = EngineOutcome(
                label,
                Outcome.FAILED,
                error=reply.failure_message,
                shutting_down=reply.failure_message == SHUTTING_DOWN,
                duration_s=duration,
            )
        pending.fanout.resolve(engine_index, outcome)
        return True

    def on_engine_hello(self, engine_index: int) -> None:
        """A new engine process starts healthy (its status forgotten at its HELLO, not once it
        is up: it may push before its READY is read); a reattached one keeps its status."""
        self.pushes.forget(self._label(engine_index))

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        if self._on_change is not None:
            self._on_change()

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        """Fail this engine's calls in flight at once (dead or restarted: no reply will come)."""
        if self._on_change is not None:
            self._on_change()
        for call_id, pending in list(self._pending.items()):
            if pending.engine_index == engine_index:
                del self._pending[call_id]
                pending.fanout.resolve(
                    engine_index, self._disconnected(engine_index, f"engine {reason}")
                )

    def on_death_claimed(self, engine_index: int) -> None:
        """Confirm an ENGINE_CORE_DEAD of unknown origin: an engine that still answers is
        alive (the claim is counted as ``unconfirmed_engine_dead``); one that does not is dead.
        One confirmation per engine at a time, whatever the number of claims."""
        if engine_index in self._confirming:
            return
        task = asyncio.get_running_loop().create_task(self._confirm_death(engine_index))
        self._confirming[engine_index] = task
        task.add_done_callback(lambda _: self._confirming.pop(engine_index, None))
        watch(task, "death_confirmation", self._faults)

    async def _confirm_death(self, engine_index: int) -> None:
        (outcome,) = await self.call_utility(
            "is_sleeping",
            timeout_s=self._death_confirm_timeout_s,
            engines=[self._label(engine_index)],
        )
        if outcome.outcome in (Outcome.OK, Outcome.FAILED):  # it answered: alive
            self._faults.record(
                "unconfirmed_engine_dead",
                f"engine {engine_index}: ENGINE_CORE_DEAD from another connection, but the "
                "engine still answers",
            )
        else:
            self.transport.confirm_dead(engine_index)
