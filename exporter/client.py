"""Utility calls over the engine-core protocol: call ids, futures, timeouts and fan-out.

``FleetClient`` is the one small interface every attach mode implements (owner and relay over
ZMQ here, HTTP dev endpoints in ``exporter.transport.http``); the poller, the admin endpoint and
the probe only ever see that interface and per-engine ``EngineOutcome``s.
"""

from __future__ import annotations

import asyncio
import contextlib
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

    def is_callable(self, engine_index: int) -> bool: ...

    def connected_count(self) -> int: ...

    def client_index(self, engine_index: int) -> int: ...

    def send_utility(self, engine_index: int, payload: bytes) -> None: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class _Pending:
    engine_index: int
    method: str
    future: asyncio.Future[EngineOutcome]
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
            if not pending.future.done():
                pending.future.cancel()
        self._pending.clear()
        await self.transport.close()

    @property
    def pending_count(self) -> int:
        return len(self._pending)

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
        loop = asyncio.get_running_loop()
        results: dict[int, EngineOutcome] = {}
        waiting: dict[int, tuple[int, asyncio.Future[EngineOutcome]]] = {}
        try:
            for idx in indices:
                if not transport.is_callable(idx):
                    results[idx] = EngineOutcome(
                        str(idx), Outcome.DISCONNECTED, error="engine not connected"
                    )
                    continue
                call_id = self._allocate_id()
                payload = encode_utility_request(transport.client_index(idx), call_id, method, args)
                future: asyncio.Future[EngineOutcome] = loop.create_future()
                self._pending[call_id] = _Pending(idx, method, future, time.perf_counter())
                try:
                    transport.send_utility(idx, payload)
                except Exception as exc:  # EngineUnavailable or a socket error
                    del self._pending[call_id]
                    results[idx] = EngineOutcome(str(idx), Outcome.DISCONNECTED, error=str(exc))
                    continue
                waiting[idx] = (call_id, future)
            if waiting:
                await asyncio.wait([f for _, f in waiting.values()], timeout=timeout_s)
            for idx, (_, future) in waiting.items():
                if future.done() and not future.cancelled():
                    results[idx] = future.result()
                else:
                    results[idx] = EngineOutcome(
                        str(idx),
                        Outcome.TIMEOUT,
                        error=f"no reply within {timeout_s:g}s",
                        duration_s=timeout_s,
                    )
        finally:
            for call_id, future in waiting.values():
                self._pending.pop(call_id, None)
                if not future.done():
                    future.cancel()
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
        if pending.future.done():
            return
        duration = time.perf_counter() - pending.sent_at
        if reply.failure_message is None:
            outcome = EngineOutcome(str(engine_index), Outcome.OK, reply.value, duration_s=duration)
        else:
            outcome = EngineOutcome(
                str(engine_index),
                Outcome.FAILED,
                error=reply.failure_message,
                shutting_down=reply.failure_message == SHUTTING_DOWN,
                duration_s=duration,
            )
        pending.future.set_result(outcome)

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
                if not pending.future.done():
                    pending.future.set_result(
                        EngineOutcome(
                            str(engine_index), Outcome.DISCONNECTED, error=f"engine {reason}"
                        )
                    )


async def cancel_quietly(task: asyncio.Task[Any]) -> None:
    """Cancel a task and wait for it, swallowing its cancellation."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
