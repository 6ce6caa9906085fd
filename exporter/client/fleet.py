"""The fleet-facing interface every attach mode implements, and its value types.

Owner and relay mode (``EngineCoreClient`` over a ZMQ transport), HTTP mode
(``HttpFleetClient``) and the in-memory ``FakeFleet`` all implement ``FleetClient``; the poller,
the admin endpoint and the probe only ever see this interface and per-engine ``EngineOutcome``s.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Collection, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from exporter.client.observe import Observations
from exporter.error import MethodNotAllowed
from exporter.protocol.activity import RequestCounts
from exporter.protocol.elastic_ep import ELASTIC_EP_PHASES as ELASTIC_EP_PHASES  # layers above
from exporter.protocol.elastic_ep import ElasticEpOperation as ElasticEpOperation  # layers above
from exporter.protocol.elastic_ep import ElasticEpRead as ElasticEpRead  # for the layers above
from exporter.protocol.handshake import REGISTRATION_FACTS
from exporter.protocol.kv_events import KvEventsSource
from exporter.protocol.pushes import FaultStatus, MembershipEvent

#: Read-only methods: the poller and the gate send only these.
READ_METHODS = frozenset(
    {
        "is_sleeping",
        "is_scheduler_paused",
        "get_weight_version",
        "has_work",
        "is_inference_ready",
        "checkpoint_state",
    }
)
#: State-changing and expensive methods: sent only by an operator's admin request.
ACTION_METHODS = frozenset(
    {
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        "sleep",
        "wake_up",
        "pause_scheduler",
        "resume_scheduler",
        "set_weight_version",
        "compute_weight_checksums",
        "checkpoint_prepare",
        "checkpoint_restore",
    }
)
#: Methods the exporter may send at all. Anything else could change an engine's state or kill
#: it (any attribute of the engine is callable by whoever reaches its input socket).
DEFAULT_ALLOWED_METHODS = READ_METHODS | ACTION_METHODS
#: The registration keys ``EngineDetail.registration`` may hold, in vLLM 0.33's order.
REGISTRATION_KEYS = tuple(key for key, _ in REGISTRATION_FACTS)
#: vLLM's failure text for utilities that arrive between SIGTERM and exit.
SHUTTING_DOWN = "Server shutting down"

#: Called (without arguments) when an engine comes up or goes down, so a poll can report it.
ChangeCallback = Callable[[], None]

#: Set by ``late_answers_allowed`` (the poller's reads): an answer that came after an earlier
#: call's deadline may answer these calls. Unset (the gate, an action's read-back), a call is
#: answered only by requests sent after it was made, or times out.
LATE_ANSWERS: ContextVar[bool] = ContextVar("late_answers", default=False)


@contextlib.contextmanager
def late_answers_allowed() -> Iterator[None]:
    """The calls made inside (and the tasks they start) may use a late answer: the poll's
    (a slow server's answer then serves the next poll instead of being lost); never a gate's."""
    token = LATE_ANSWERS.set(True)
    try:
        yield
    finally:
        LATE_ANSWERS.reset(token)


class Outcome(str, enum.Enum):
    """What happened to one engine's utility call."""

    OK = "ok"
    FAILED = "failed"  # the engine answered with a failure message
    TIMEOUT = "timeout"  # no answer within the call timeout
    DISCONNECTED = "disconnected"  # not connected, not routable, dead or restarted
    INCONSISTENT = "inconsistent"  # an HTTP target whose own engines disagreed


class EngineOutcome(msgspec.Struct, frozen=True):
    """One engine's (or HTTP target's) outcome for one call.

    A frozen ``msgspec.Struct`` rather than a frozen dataclass: one is built per engine per
    call, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) costs
    several times a Struct's (``python -m bench.hotpath``)."""

    engine: str
    outcome: Outcome
    value: Any = None
    error: str | None = None
    shutting_down: bool = False
    duration_s: float | None = None
    #: For an INCONSISTENT HTTP target: the values its own engines returned.
    values: tuple[Any, ...] = ()
    #: Not asked: what a live source of the mode told (a poll's ``has_work`` from the rank's
    #: request counts, ``observe.WORK_COUNTS``; ``exporter.control.fleetread``).
    told: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def check_allowed(method: str, allowed: Collection[str]) -> None:
    """``MethodNotAllowed`` unless ``method`` is on the allow-list: every attach mode refuses
    the same way, before anything is sent."""
    if method not in allowed:
        raise MethodNotAllowed(f"utility method {method!r} is not on the allow-list")


#: What every mode answers for a call in flight when the client closes, and for any call
#: after: nothing more is sent (``stopping``).
STOPPING = "the exporter is stopping"


def stopping(engine: str) -> EngineOutcome:
    """The outcome of a call the client ended, or refused, because it is closing."""
    return EngineOutcome(engine, Outcome.DISCONNECTED, error=STOPPING)


def timed_out(engine: str, timeout_s: float) -> EngineOutcome:
    """The outcome of an engine that did not answer within the fan-out's shared deadline."""
    return EngineOutcome(
        engine, Outcome.TIMEOUT, error=f"no reply within {timeout_s:g}s", duration_s=timeout_s
    )


#: ``EngineDetail.front_end`` values: vLLM's Python API server (or its Python client in a
#: trainer's process), its Rust front end.
PYTHON_FRONT_END, RUST_FRONT_END = "python", "rust"


@dataclass(frozen=True, slots=True)
class EngineDetail:
    """What the status page shows about one engine beside its poll results."""

    engine: str
    connected: bool
    address: str
    vllm_version: str | None = None
    #: The API server it is read through (HTTP and in-process mode): ``python`` (vLLM's
    #: Python API server) or ``rust`` (``VLLM_USE_RUST_FRONTEND=1``), with the Rust front
    #: end's own version from ``GET /version``; None: not known, or no front end in the way.
    front_end: str | None = None
    rust_frontend_version: str | None = None
    enable_sleep_mode: bool | None = None
    handshakes: int = 0
    #: The engine's KV-events publisher from its registration (owner, relay and in-process
    #: mode); None: it publishes none, or this attach mode cannot know.
    kv_events: KvEventsSource | None = None
    #: What the engine said about itself when it registered (``REGISTRATION_FACTS`` keys it
    #: sent, in that order; empty: no registration, or this attach mode cannot know).
    registration: tuple[tuple[str, Any], ...] = ()
    #: Its last fault-tolerance status (vLLM's sentinel; None: never reported).
    fault_status: FaultStatus | None = None
    #: Its last elastic-EP notification (None: none since its handshake).
    membership: MembershipEvent | None = None
    #: Pushes received from it, by kind (``exporter.protocol.pushes.PUSH_KINDS``).
    pushes: tuple[tuple[str, int], ...] = ()
    #: Its running and waiting requests as vLLM last published them (None: unknown here, or
    #: this attach mode cannot know: ``Capabilities.request_counts``).
    requests: RequestCounts | None = None


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What an attach mode can do and know: the layers above ask this, never the mode's name."""

    #: It learns each engine's fault-tolerance status (owner: pushed to client 0; HTTP: each
    #: server's ``GET /fault_tolerance/status``; in-process: the front end's own copy). Relay
    #: mode cannot: the engines push to the front end.
    fault_status: bool = False
    #: A front end owns the engines beside the exporter (relay mode): an action that changes
    #: their state runs only when the operator allowed it (``--relay-allow-state-changes``).
    beside_a_front_end: bool = False
    #: It runs a supervised handshake loop (owner and relay mode): its failures are counted in
    #: ``vllm_dp_task_failures_total{task="handshake"}`` from the start.
    handshakes: bool = False
    #: It learns each rank's running and waiting requests (``EngineDetail.requests``):
    #: in-process (the front end's load-balancing counts) and HTTP mode (vLLM's ``/metrics``).
    request_counts: bool = False
    #: The methods it can ask at all (its allow-list; HTTP mode: those with a route): a method
    #: outside is not asked, or counted.
    methods: frozenset[str] = DEFAULT_ALLOWED_METHODS
    #: Each engine is asked on its own, a call per engine and method (owner, relay,
    #: in-process): a paced poll reads a burst of engines at a time. HTTP mode asks a server
    #: for all of its ranks in one request: its polls read every server at once.
    calls_per_engine: bool = True


#: A counter the client keeps of its own (``observe.CLIENT_COUNT``): the metric family it is
#: published as, and its counts by the family's one label.
ClientCounters = Mapping[str, Mapping[str, int]]


class FleetClient(Protocol):
    """One outcome per engine for every call, and its lifecycle: the interface all attach
    modes implement. Everything else a mode learns reaches the layers above through its
    ``observations`` (``exporter.client.observe``)."""

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def engine_labels(self) -> list[str]: ...

    def engine_details(self) -> list[EngineDetail]: ...

    @property
    def observations(self) -> Observations:
        """What this mode learns besides its calls' answers (one seam for every such fact)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        """One outcome per engine called (``engines``, labels; None: every engine), in
        engine order."""
        ...


def connected_count(client: FleetClient) -> int:
    """How many of ``client``'s engines are connected now."""
    return sum(1 for d in client.engine_details() if d.connected)
