"""``GET /status`` as typed objects (pure): the fleet's verdict per invariant and each
engine's state, the subset a training script or a controller acts on. ``raw`` keeps the whole
document (docs/status.md, ``docs/status.schema.json``), keys added by newer exporters included.

The same rules as ``exporter.remote.results``: a missing key takes its default, a key of the
wrong type is an ``InvalidAnswer``, strings are kept as sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.remote.errorbase import InvalidAnswer
from exporter.remote.results import EngineRequests, Fields, find_engine

#: The invariants every poll checks (``aggregate.<method>``, each engine's ``invariants``).
INVARIANTS = ("is_sleeping", "is_scheduler_paused", "get_weight_version")


@dataclass(frozen=True)
class Verdict:
    """The fleet's verdict on one invariant: ``consistent`` (every answering engine agrees on
    ``value``), ``inconsistent`` or ``unknown``."""

    state: str
    value: Any = None
    supported: bool = True
    error: str | None = None
    #: Engines whose answer is unknown (failed, timed out, disconnected).
    missing: tuple[str, ...] = ()
    #: Engines whose vLLM has no such method.
    unsupported: tuple[str, ...] = ()
    #: ``state``, or ``unsupported`` when no engine can answer it (an older vLLM).
    outcome: str | None = None

    @property
    def consistent(self) -> bool:
        return self.state == "consistent"

    @classmethod
    def from_json(cls, data: Any, where: str) -> Verdict:
        f = Fields(data, where)
        return cls(
            state=f.text("state") or "unknown",
            value=f.data.get("value"),
            supported=f.truth("supported", True),
            error=f.text("error"),
            missing=f.labels("missing"),
            unsupported=f.labels("unsupported"),
            outcome=f.text("outcome") or f.text("state"),
        )


@dataclass(frozen=True)
class EngineInvariant:
    """One engine's answer to one invariant in the last poll; ``outcome`` ``ok``, ``failed``,
    ``timeout``, ``disconnected``, ``inconsistent``, ``unsupported`` or None (not asked)."""

    value: Any = None
    outcome: str | None = None
    error: str | None = None

    @classmethod
    def from_json(cls, data: Any, where: str) -> EngineInvariant:
        f = Fields(data, where)
        return cls(f.data.get("value"), f.text("outcome"), f.text("error"))


@dataclass(frozen=True)
class EngineStatus:
    """One engine's row: connected, answering (``up``), its state (``awake``, ``asleep``,
    ``paused``, ``hung``, ``unknown``), its invariants, whether it should take traffic and
    what it is doing (``has_work``, ``running``, ``waiting``, ``drained``)."""

    engine: str
    connected: bool
    up: bool
    state: str
    vllm_version: str | None = None
    #: ``python`` or ``rust``: the API server it is read through (None: not known, or an
    #: exporter older than the field), and the Rust front end's version.
    front_end: str | None = None
    rust_frontend_version: str | None = None
    address: str | None = None
    handshakes: int | None = None
    invariants: Mapping[str, EngineInvariant] = field(default_factory=dict)
    #: Its last fault-tolerance status (``healthy``, ``unhealthy``, ``dead``, ``paused``,
    #: ``recovering``, ``other``, ``unknown``; None: never reported) and ``fault_info``
    #: (docs/fault-tolerance.md).
    fault_status: str | None = None
    fault_info: str | None = None
    #: Whether a router should send it traffic and why not (None: an exporter older than
    #: this field; docs/activity.md), and seconds since it last answered while connected.
    routable: bool | None = None
    unroutable_reasons: tuple[str, ...] = ()
    unresponsive_seconds: float | None = None
    #: What it is doing (``activity`` in ``/status``, docs/activity.md): vLLM's ``has_work``
    #: answer, its running and waiting requests as vLLM last published them, and whether it
    #: is drained (``has_work`` false and no published count above zero). None: not known in
    #: this attach mode or this poll, or an exporter older than these fields.
    has_work: bool | None = None
    running: int | None = None
    waiting: int | None = None
    drained: bool | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def weight_version(self) -> Any:
        """Its ``get_weight_version`` answer while it is up, else None."""
        found = self.invariants.get("get_weight_version")
        return found.value if found is not None and self.up else None

    @property
    def requests(self) -> EngineRequests | None:
        """Its running and waiting requests when both are known, else None."""
        if self.running is None or self.waiting is None:
            return None
        return EngineRequests(self.running, self.waiting)

    @classmethod
    def from_json(cls, data: Any, where: str) -> EngineStatus:
        f = Fields(data, where)
        invariants = f.mapping("invariants")
        ft = Fields(f.mapping("fault_tolerance"), f"{where}.fault_tolerance")
        route = Fields(f.mapping("routable"), f"{where}.routable")
        reasons = route.data.get("reasons") or []
        if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
            raise InvalidAnswer(f"{where}.routable.reasons must be a list of strings")
        activity = Fields(f.mapping("activity"), f"{where}.activity")
        return cls(
            engine=f.label(),
            connected=f.truth("connected"),
            up=f.truth("up"),
            state=f.text("state") or "unknown",
            vllm_version=f.text("vllm_version"),
            front_end=f.text("front_end"),
            rust_frontend_version=f.text("rust_frontend_version"),
            address=f.text("address"),
            handshakes=f.integer("handshakes"),
            invariants={
                name: EngineInvariant.from_json(value, f"{where}.invariants.{name}")
                for name, value in invariants.items()
            },
            fault_status=ft.text("status"),
            fault_info=ft.text("fault_info"),
            routable=route.flag("routable", None),
            unroutable_reasons=tuple(reasons),
            unresponsive_seconds=f.number("unresponsive_seconds"),
            has_work=activity.flag("has_work", None),
            running=activity.count("running"),
            waiting=activity.count("waiting"),
            drained=activity.flag("drained", None),
            raw=f.data,
        )


@dataclass(frozen=True)
class ElasticEpOperationStatus:
    """One API server's elastic-EP operation (``elastic_ep_operations`` in ``/status``,
    docs/status.md): its ``phase`` (``idle``, ``preparing``, ``committing``, ``completed``,
    ``failed``, ``other``: the string in ``reported_phase``; None while not known, ``problem``
    says why), whether serving is paused for it (``scaling``), its epoch, error and requested
    data-parallel size; ``supported`` False where the server has no such route."""

    target: str
    phase: str | None = None
    scaling: bool | None = None
    epoch: str | None = None
    error: str | None = None
    requested_data_parallel_size: int | None = None
    reported_phase: str | None = None
    supported: bool = True
    read_at_unix: float | None = None
    problem: str | None = None

    @property
    def failed(self) -> bool:
        return self.phase == "failed"

    @classmethod
    def from_json(cls, data: Any, where: str) -> ElasticEpOperationStatus:
        f = Fields(data, where)
        target = f.text("target")
        if target is None:
            raise InvalidAnswer(f"{where}.target must be a string")
        return cls(
            target=target,
            phase=f.text("phase"),
            scaling=f.flag("scaling", None),
            epoch=f.text("epoch"),
            error=f.text("error"),
            requested_data_parallel_size=f.count("requested_data_parallel_size"),
            reported_phase=f.text("reported_phase"),
            supported=f.truth("supported", True),
            read_at_unix=f.number("read_at_unix"),
            problem=f.text("problem"),
        )


@dataclass(frozen=True)
class Status:
    """The ``/status`` document."""

    version: str | None
    attach: str | None
    model_name: str | None
    #: The first poll completed and every expected engine handshook.
    ready: bool
    engines_expected: int | None
    engines_connected: int | None
    #: The number of the last completed poll (None before the first).
    last_poll: int | None
    aggregate: Mapping[str, Verdict]
    engines: tuple[EngineStatus, ...]
    generated_unix: float | None = None
    #: No engine reports a fault-tolerance status but healthy (an exporter older than this
    #: field: True; None: the attach mode cannot know, relay), and the engines that do.
    healthy: bool | None = True
    faulty_engines: tuple[str, ...] = ()
    #: Each API server's elastic-EP operation, in target order (None: the attach mode has no
    #: API server to ask, owner and relay, or an exporter older than the field).
    elastic_ep_operations: tuple[ElasticEpOperationStatus, ...] | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def sleeping(self) -> Verdict:
        """The fleet's ``is_sleeping`` verdict (``unknown`` when the document has none);
        ``ctl status`` exits 0 only when it is consistent."""
        return self.aggregate.get("is_sleeping") or Verdict("unknown")

    @property
    def consistent(self) -> bool:
        return self.sleeping.consistent

    def engine(self, label: str | int) -> EngineStatus:
        """One engine's row (``KeyError`` when the document does not name it)."""
        return find_engine(self.engines, label)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> Status:
        f = Fields(body, "the status")
        poll = Fields(f.mapping("last_poll"), "the status.last_poll")
        aggregate = f.mapping("aggregate")
        ft = Fields(f.mapping("fault_tolerance"), "the status.fault_tolerance")
        return cls(
            version=f.text("version"),
            attach=f.text("attach"),
            model_name=f.text("model_name"),
            ready=f.truth("ready"),
            engines_expected=f.integer("engines_expected"),
            engines_connected=f.integer("engines_connected"),
            last_poll=poll.integer("number"),
            aggregate={
                name: Verdict.from_json(value, f"aggregate.{name}")
                for name, value in aggregate.items()
            },
            engines=tuple(
                EngineStatus.from_json(e, f"engines[{i}]") for i, e in enumerate(f.items("engines"))
            ),
            generated_unix=f.number("generated_unix"),
            healthy=ft.flag("healthy", True),
            faulty_engines=ft.labels("faulty_engines"),
            elastic_ep_operations=None
            if f.data.get("elastic_ep_operations") is None
            else tuple(
                ElasticEpOperationStatus.from_json(o, f"elastic_ep_operations[{i}]")
                for i, o in enumerate(f.items("elastic_ep_operations"))
            ),
            raw=body,
        )
