"""An in-memory fleet: the ``FleetClient`` interface with a handler instead of engines.

As httpx's ``MockTransport`` does for HTTP, ``FakeFleet`` takes one function that answers every
call (``handler(engine, method, args)``) and implements the same interface as the real attach
modes, so the poller, metrics, admin and status code run in tests and benchmarks without
sockets. The real-socket tests stay the main proof; this is the fast tier (``make unit``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from exporter.client.fleet import (
    DEFAULT_ALLOWED_METHODS,
    Capabilities,
    EngineDetail,
    EngineOutcome,
    Outcome,
    check_allowed,
    stopping,
)
from exporter.client.observe import ELASTIC_EP_OPERATION, Observation, Observations
from exporter.protocol.elastic_ep import ElasticEpRead
from exporter.protocol.kv_events import KvEventsSource
from exporter.protocol.strings import bound_text, bound_value

#: ``handler(engine label, method, args)``: a value is an OK answer; an ``EngineOutcome`` is
#: returned as it is (failed, timeout, disconnected ...).
Handler = Callable[[str, str, tuple[Any, ...]], Any]


@dataclass
class FakeFleet:
    """``FleetClient`` over ``handler``; engines listed in ``disconnected`` are not called."""

    handler: Handler
    engines: Sequence[str] = ("0", "1")
    allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS
    unsupported: frozenset[str] = frozenset()
    #: What this fake says it can do (a mode that learns fault-tolerance statuses, by default).
    fake_capabilities: Capabilities = field(default_factory=lambda: Capabilities(fault_status=True))
    disconnected: set[str] = field(default_factory=set)
    #: Closed: every call ends ``stopping`` (as in every mode).
    closed: bool = False
    vllm_version: str | None = "0.33.0"
    #: Engine → its KV-events publisher (as a registration would carry it).
    kv_events: dict[str, KvEventsSource] = field(default_factory=dict)
    #: Engine → ``enable_sleep_mode`` as registered (absent: True).
    sleep_mode: dict[str, bool | None] = field(default_factory=dict)
    #: What each API server said of its elastic-EP operation (None: a mode without one).
    elastic_ep: tuple[ElasticEpRead, ...] | None = None
    #: Every call made, in order: (engine, method, args).
    calls: list[tuple[str, str, tuple[Any, ...]]] = field(default_factory=list)
    started: bool = False

    @property
    def engine_labels(self) -> list[str]:
        return list(self.engines)

    def engine_details(self) -> list[EngineDetail]:
        return [
            EngineDetail(
                engine=e,
                connected=e not in self.disconnected,
                address=f"fake://{e}",
                vllm_version=self.vllm_version,
                enable_sleep_mode=self.sleep_mode.get(e, True),
                handshakes=1,
                kv_events=self.kv_events.get(e),
            )
            for e in self.engines
        ]

    @property
    def capabilities(self) -> Capabilities:
        methods = self.allowed_methods - self.unsupported
        return dataclasses.replace(self.fake_capabilities, methods=methods)

    @property
    def observations(self) -> Observations:
        """``elastic_ep`` as a test set it (a source only when set: None is a mode without
        an API server to ask)."""
        board = Observations()
        if self.elastic_ep is not None:
            reads = self.elastic_ep
            board.add_source(
                ELASTIC_EP_OPERATION,
                lambda: [
                    Observation(r.target, ELASTIC_EP_OPERATION, r, r.read_at_unix or 0.0, "fake")
                    for r in reads
                ],
            )
        return board

    async def start(self) -> None:
        self.started, self.closed = True, False

    async def close(self) -> None:
        self.started, self.closed = False, True

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        check_allowed(method, self.allowed_methods)
        outcomes = []
        for engine in self.engines:
            if engines is not None and engine not in engines:
                continue
            if self.closed:
                outcomes.append(stopping(engine))
                continue
            if engine in self.disconnected:
                outcomes.append(
                    EngineOutcome(engine, Outcome.DISCONNECTED, error="engine is not connected")
                )
                continue
            self.calls.append((engine, method, args))
            answer = self.handler(engine, method, args)
            if isinstance(answer, EngineOutcome):  # the one rule for engine strings, here too
                error = bound_text(answer.error) if answer.error is not None else None
                value = bound_value(answer.value)
                outcomes.append(msgspec.structs.replace(answer, value=value, error=error))
            else:
                value = bound_value(answer)
                outcomes.append(EngineOutcome(engine, Outcome.OK, value, duration_s=0.001))
        return outcomes


def answers(values: dict[str, dict[str, Any]]) -> Handler:
    """A handler from fixed answers: ``{engine: {method: value}}``; a missing method fails as
    vLLM's engine does for an unknown attribute."""

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        per_engine = values.get(engine, {})
        if method not in per_engine:
            text = f"Call to {method} method failed: 'EngineCoreProc' object has no attribute"
            return EngineOutcome(engine, Outcome.FAILED, error=text, duration_s=0.001)
        return per_engine[method]

    return handler
