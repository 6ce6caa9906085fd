"""Utility calls over the engine-core protocol: call ids, futures, timeouts and fan-out.

``FleetClient`` is the one small interface every attach mode implements (owner and relay over
ZMQ here, HTTP dev endpoints in ``exporter.transport.http``); the poller, the admin endpoint and
the probe only ever see that interface and per-engine ``EngineOutcome``s.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from exporter.aggregate import EngineOutcome, Outcome
from exporter.error import MethodNotAllowed
from exporter.protocol import UINT64_MAX, EngineOutput, encode_utility_request
from exporter.transport.events import EngineLinkView, ProtocolErrorTally

log = logging.getLogger("exporter.client")

#: Methods the exporter may send. Anything else could change an engine's state or kill it.
DEFAULT_ALLOWED_METHODS = frozenset({"is_sleeping", "is_scheduler_paused", "reset_prefix_cache"})
SHUTTING_DOWN = "Server shutting down"


@dataclass(frozen=True, slots=True)
class EngineDetail:
    """What the status page shows about one engine beside its poll results."""

    engine: str
    connected: bool
    address: str
    vllm_version: str | None = None
    enable_sleep_mode: bool | None = None
    handshakes: int = 0


class FleetClient(Protocol):
    """One outcome per engine for every call: the interface all attach modes implement."""

    @property
    def engine_labels(self) -> list[str]: ...

    def engine_details(self) -> list[EngineDetail]: ...

    def connected_count(self) -> int: ...

    def supports(self, method: str) -> bool:
        """Whether this attach mode can ask ``method`` at all (HTTP has no paused route)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def call_utility(
        self, method: str, args: tuple[Any, ...] = (), *, timeout_s: float
    ) -> list[EngineOutcome]: ...


class ZmqTransport(Protocol):
    """What ``EngineCoreClient`` needs from a ZMQ transport (owner or relay)."""

    @property
    def engine_indices(self) -> list[int]: ...

    def link_views(self) -> list[EngineLinkView]: ...

    def connected_count(self) -> int: ...

    def client_index(self, engine_index: int) -> int: ...

    def send_utility(self, engine_index: int, payload: bytes) -> None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class _FanOut:
    """The outcomes of one fan-out, and one future set when the last engine answered: a
    fan-out over N engines costs one future and one timer, not N."""

    __slots__ = ("done", "remaining", "results")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.done: asyncio.Future[None] = loop.create_future()
        self.remaining = 0
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
        errors: ProtocolErrorTally,
        *,
        allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS,
    ) -> None:
        self._errors = errors
        self._allowed = allowed_methods
        self._pending: dict[int, _Pending] = {}
        self._labels: dict[int, str] = {}
        # Random start: a restarted exporter does not reuse the ids its predecessor had in flight.
        self._next_id = random.getrandbits(64)
        self._transport: ZmqTransport | None = None
        #: Called when an engine comes up or goes down, so a poll can report it at once.
        self.on_change: Callable[[], None] | None = None

    def attach(self, transport: ZmqTransport) -> None:
        self._transport = transport

    @property
    def transport(self) -> ZmqTransport:
        if self._transport is None:
            raise RuntimeError("EngineCoreClient has no transport attached")
        return self._transport

    # -- FleetClient -----------------------------------------------------------------------

    @property
    def engine_labels(self) -> list[str]:
        return [str(i) for i in self.transport.engine_indices]

    def engine_details(self) -> list[EngineDetail]:
        details = []
        for view in self.transport.link_views():
            reg = view.registration
            details.append(
                EngineDetail(
                    engine=str(view.engine_index),
                    connected=view.connected,
                    address=view.output_address,
                    vllm_version=reg.vllm_version if reg else None,
                    enable_sleep_mode=reg.enable_sleep_mode if reg else None,
                    handshakes=view.handshakes,
                )
            )
        return details

    def connected_count(self) -> int:
        return self.transport.connected_count()

    def supports(self, method: str) -> bool:
        return method in self._allowed

    async def start(self) -> None:
        await self.transport.start()

    async def close(self) -> None:
        for pending in self._pending.values():
            if not pending.fanout.done.done():
                pending.fanout.done.cancel()
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
        engines: Sequence[int] | None = None,
    ) -> list[EngineOutcome]:
        """Call ``method`` on every engine at once; one outcome per engine, in engine order.

        Engines that are not connected get DISCONNECTED without a send; every other engine
        gets the shared deadline ``timeout_s``, so a hung engine delays nothing beyond it.
        """
        if method not in self._allowed:
            raise MethodNotAllowed(f"utility method {method!r} is not on the allow-list")
        transport = self.transport
        indices = list(transport.engine_indices if engines is None else engines)
        fanout = _FanOut(asyncio.get_running_loop())
        results = fanout.results
        sent: list[int] = []
        try:
            for idx in indices:
                call_id = self._allocate_id()
                fanout.remaining += 1
                self._pending[call_id] = _Pending(idx, fanout, time.perf_counter())
                try:
                    # The transport refuses engines that are not connected or not routable.
                    payload = encode_utility_request(
                        transport.client_index(idx), call_id, method, args
                    )
                    transport.send_utility(idx, payload)
                except Exception as exc:  # EngineUnavailable or a socket error
                    del self._pending[call_id]
                    fanout.resolve(
                        idx, EngineOutcome(self._label(idx), Outcome.DISCONNECTED, error=str(exc))
                    )
                    continue
                sent.append(call_id)
            if fanout.remaining > 0:
                await asyncio.wait((fanout.done,), timeout=timeout_s)
            for idx in indices:
                if idx not in results:
                    results[idx] = EngineOutcome(
                        self._label(idx),
                        Outcome.TIMEOUT,
                        error=f"no reply within {timeout_s:g}s",
                        duration_s=timeout_s,
                    )
        finally:
            for call_id in sent:
                self._pending.pop(call_id, None)
            if not fanout.done.done():
                fanout.done.cancel()
        return [results[idx] for idx in indices]

    # -- TransportListener -----------------------------------------------------------------

    def on_output(self, engine_index: int, output: EngineOutput) -> None:
        reply = output.utility
        if reply is None:
            self._errors.record("non_utility_output", f"engine {engine_index}: not a utility reply")
            return
        pending = self._pending.get(reply.call_id)
        if pending is None:
            self._errors.record(
                "unknown_call_id", f"engine {engine_index}: reply to unknown call {reply.call_id}"
            )
            return
        if pending.engine_index != engine_index:
            self._errors.record(
                "wrong_engine",
                f"engine {engine_index} answered call {reply.call_id} sent to "
                f"engine {pending.engine_index}",
            )
            return
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

    def on_engine_up(self, engine_index: int) -> None:
        if self.on_change is not None:
            self.on_change()

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        """Fail this engine's calls in flight at once (dead or restarted: no reply will come)."""
        if self.on_change is not None:
            self.on_change()
        for call_id, pending in list(self._pending.items()):
            if pending.engine_index == engine_index:
                del self._pending[call_id]
                outcome = EngineOutcome(
                    self._label(engine_index), Outcome.DISCONNECTED, error=f"engine {reason}"
                )
                pending.fanout.resolve(engine_index, outcome)
