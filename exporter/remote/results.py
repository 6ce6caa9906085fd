"""The answers of admin actions and of the gate as typed objects (pure: JSON in, objects out).

A key the answer lacks takes its default (an older or newer exporter may not send it); a key of
the wrong type is an ``InvalidAnswer`` naming it, so a caller never meets a string where the
type says a boolean. Strings are kept as the exporter sent them (a weight version is compared
exactly): escape them with ``exporter.remote.printable`` before printing them to a terminal.
``raw`` keeps the whole JSON object, with keys this client does not know.

Engines are named by their label as ``/status`` and ``/gate`` name them (``"0"``, ``"1"``; an
HTTP target's name): the admin answers' numeric indices become the same strings, so outcomes,
gate answers and status rows compare equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from exporter.remote.errorbase import InvalidAnswer

#: Per-engine reasons of an action (exporter.control.verdicts; docs/rl.md).
REASONS = ("refused", "failed", "timeout", "disconnected", "unsupported", "unverified", "mismatch")
#: Fleet outcomes of an action (exporter.fleetstate.aggregate.fleet_outcome).
OUTCOMES = ("success", "partial_failure", "failure", "unsupported")


class _Labelled(Protocol):
    @property
    def engine(self) -> str: ...


_Row = TypeVar("_Row", bound=_Labelled)


def find_engine(rows: Iterable[_Row], label: str | int) -> _Row:
    """The row of engine ``label`` (an index or an HTTP target's name); ``KeyError`` when
    none names it."""
    wanted = str(label)
    for row in rows:
        if row.engine == wanted:
            return row
    raise KeyError(wanted)


class Fields:
    """Typed reads of one JSON object; ``where`` names it in errors (``engines[2]``)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise InvalidAnswer(f"{where} must be a JSON object, got {_kind(data)}")
        self.data: Mapping[str, Any] = data
        self.where = where

    def _bad(self, key: str, expected: str, value: Any) -> InvalidAnswer:
        return InvalidAnswer(f"{self.where}.{key} must be {expected}, got {_kind(value)}")

    def text(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, str):
            raise self._bad(key, "a string or null", value)
        return value

    def flag(self, key: str, default: bool | None = False) -> bool | None:
        value = self.data.get(key, default)
        if value is not None and not isinstance(value, bool):
            raise self._bad(key, "a boolean", value)
        return value

    def truth(self, key: str, default: bool = False) -> bool:
        value = self.flag(key, default)
        return default if value is None else value

    def number(self, key: str) -> float | None:
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, "a number or null", value)
        return float(value)

    def integer(self, key: str) -> int | None:
        value = self.data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise self._bad(key, "an integer or null", value)
        return value

    def count(self, key: str) -> int | None:
        """A count: a whole number, 0 or more (``-1`` or ``1.5`` is an ``InvalidAnswer``)."""
        value = self.data.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            shown = repr(value) if number else _kind(value)
            raise InvalidAnswer(
                f"{self.where}.{key} must be a count (a whole number, 0 or more) or null, "
                f"got {shown}"
            )
        return value

    def items(self, key: str) -> list[Any]:
        value = self.data.get(key, [])
        if value is None:
            return []
        if not isinstance(value, list):
            raise self._bad(key, "an array", value)
        return value

    def mapping(self, key: str) -> Mapping[str, Any]:
        value = self.data.get(key, {})
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            raise self._bad(key, "an object", value)
        return value

    def texts(self, key: str) -> tuple[str, ...]:
        values = self.items(key)
        for i, value in enumerate(values):
            if not isinstance(value, str):
                raise self._bad(f"{key}[{i}]", "a string", value)
        return tuple(values)

    def label(self, key: str = "engine") -> str:
        return engine_label(self.data.get(key, ""), f"{self.where}.{key}")

    def labels(self, key: str) -> tuple[str, ...]:
        return tuple(
            engine_label(v, f"{self.where}.{key}[{i}]") for i, v in enumerate(self.items(key))
        )


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "a number", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "an object", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def engine_label(value: Any, where: str) -> str:
    """An engine's index (a number) or label (a string) as its label."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise InvalidAnswer(f"{where} must be an engine index or label, got {_kind(value)}")


@dataclass(frozen=True)
class EngineResult:
    """One engine's part in an admin action."""

    engine: str
    #: The engine confirmed (and, where the state can be read back, shows it).
    ok: bool
    #: Why not: one of ``REASONS`` (None when ``ok``).
    reason: str | None = None
    #: The engine's or the exporter's error text.
    error: str | None = None
    #: The state read back afterwards (verified actions; None: not read back or unknown).
    state: Any = None
    #: ``verify_weights``: parameters whose checksum differs from the majority's.
    mismatches: int | None = None
    mismatching_parameters: tuple[str, ...] = ()
    #: ``verify_weights``: the parameters the engine returned, those actually compared, and
    #: those that could not be (every rank's checksum is the digest of empty input; at most
    #: 20 named, the count is complete). None: not compared, or an older exporter.
    parameters: int | None = None
    compared: int | None = None
    unverifiable: int | None = None
    unverifiable_parameters: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Any, where: str) -> EngineResult:
        f = Fields(data, where)
        return cls(
            engine=f.label(),
            ok=f.truth("ok"),
            reason=f.text("reason"),
            error=f.text("error"),
            state=f.data.get("state"),
            mismatches=f.integer("mismatches"),
            mismatching_parameters=f.texts("mismatching_parameters"),
            parameters=f.integer("parameters"),
            compared=f.integer("compared"),
            unverifiable=f.integer("unverifiable"),
            unverifiable_parameters=f.texts("unverifiable_parameters"),
        )


@dataclass(frozen=True)
class ActionResult:
    """The answer of ``POST /admin/<action>``: the fleet's outcome and every engine's."""

    action: str
    #: The HTTP status: 200 every engine confirmed, 502 some did not, 501 no engine supports
    #: the action, 503 none connected.
    status: int
    success: bool
    #: ``success``, ``partial_failure``, ``failure`` or ``unsupported``.
    outcome: str
    engines: tuple[EngineResult, ...]
    failed_engines: tuple[str, ...]
    #: The parameters as the exporter understood them (the reset's ``flags``).
    params: Mapping[str, Any]
    #: Whether the state was read back on every engine (None: the reset, which has no state).
    verified: bool | None = None
    duration_s: float | None = None
    error: str | None = None
    #: The answer is the stored one of an earlier request with the same Idempotency-Key.
    replayed: bool = False
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def failures(self) -> tuple[EngineResult, ...]:
        """The engines that did not confirm."""
        return tuple(e for e in self.engines if not e.ok)

    @property
    def unsupported(self) -> bool:
        """No engine supports the action (HTTP 501, outcome ``unsupported``)."""
        return self.outcome == "unsupported"

    @property
    def unsupported_engines(self) -> tuple[EngineResult, ...]:
        """The engines whose vLLM lacks the method (in a partial failure too)."""
        return tuple(e for e in self.engines if e.reason == "unsupported")

    def engine(self, label: str | int) -> EngineResult:
        """The outcome of one engine (``KeyError`` when the answer does not name it)."""
        return find_engine(self.engines, label)

    @classmethod
    def from_json(
        cls, action: str, status: int, body: Mapping[str, Any], replayed: bool = False
    ) -> ActionResult:
        f = Fields(body, "the answer")
        engines = tuple(
            EngineResult.from_json(e, f"engines[{i}]") for i, e in enumerate(f.items("engines"))
        )
        params = f.mapping("params") if "params" in body else f.mapping("flags")
        outcome = f.text("outcome") or ("success" if status == 200 else "failure")
        return cls(
            action=f.text("action") or action,
            status=status,
            success=f.truth("success", status == 200),
            outcome=outcome,
            engines=engines,
            failed_engines=f.labels("failed_engines"),
            params=dict(params),
            verified=f.flag("verified", None),
            duration_s=f.number("duration_s"),
            error=f.text("error"),
            replayed=replayed,
            raw=body,
        )


@dataclass(frozen=True)
class EngineRequests:
    """One rank's requests as vLLM last published them: ``running`` (scheduled) and
    ``waiting`` (queued, e.g. behind a paused scheduler); docs/activity.md."""

    running: int
    waiting: int

    @property
    def total(self) -> int:
        return self.running + self.waiting

    def __str__(self) -> str:
        return f"running {self.running}, waiting {self.waiting}"

    @classmethod
    def from_json(cls, data: Any, where: str) -> EngineRequests | None:
        """``{"running": n, "waiting": n}``, or None for null (not known in this attach mode,
        or not this time); anything else is an ``InvalidAnswer``."""
        if data is None:
            return None
        f = Fields(data, where)
        running, waiting = f.count("running"), f.count("waiting")
        if running is None or waiting is None:
            raise InvalidAnswer(f"{where} must have both counts, running and waiting")
        return cls(running, waiting)


@dataclass(frozen=True)
class GateEngine:
    """One engine in a gate answer: whether it meets every condition, what it reported, and
    what fails (``"paused is True, expected False"``; ``"drained: has work (running 1,
    waiting 0), expected drained=true"``)."""

    engine: str
    ok: bool
    values: Mapping[str, Any]
    failures: tuple[str, ...]
    #: Its running and waiting requests as vLLM last published them; None where the attach
    #: mode does not learn them (owner mode; docs/activity.md), not this time, or an older
    #: exporter.
    requests: EngineRequests | None = None

    @property
    def has_work(self) -> bool | None:
        """Its ``has_work`` answer (a gate without conditions reads it), else None."""
        value = self.values.get("has_work")
        return value if isinstance(value, bool) else None

    @property
    def drained(self) -> bool | None:
        """Whether it is drained (a gate asked ``drained``: ``has_work`` false and no published
        request), else None (not asked, or unknown)."""
        value = self.values.get("drained")
        return value if isinstance(value, bool) else None

    @classmethod
    def from_json(cls, data: Any, where: str) -> GateEngine:
        f = Fields(data, where)
        return cls(
            f.label(),
            f.truth("ok"),
            dict(f.mapping("values")),
            f.texts("failures"),
            EngineRequests.from_json(f.data.get("requests"), f"{where}.requests"),
        )


@dataclass(frozen=True)
class GateResult:
    """The answer of ``GET /gate``: open (``ok``, HTTP 200) when every expected engine answered
    and meets every condition; closed otherwise (412 naming what fails, 503 when no engine is
    connected)."""

    ok: bool
    status: int
    conditions: Mapping[str, Any]
    engines: tuple[GateEngine, ...]
    failing_engines: tuple[str, ...]
    #: When the fresh fan-out behind the answer was taken (Unix time) and its age then.
    checked_at_unix: float | None = None
    age_s: float | None = None
    error: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def failing(self) -> tuple[GateEngine, ...]:
        return tuple(e for e in self.engines if not e.ok)

    @classmethod
    def from_json(cls, status: int, body: Mapping[str, Any]) -> GateResult:
        f = Fields(body, "the answer")
        engines = tuple(
            GateEngine.from_json(e, f"engines[{i}]") for i, e in enumerate(f.items("engines"))
        )
        return cls(
            ok=status == 200,  # the status is the gate's verdict (what ctl wait acts on)
            status=status,
            conditions=dict(f.mapping("conditions")),
            engines=engines,
            failing_engines=f.labels("failing_engines"),
            checked_at_unix=f.number("checked_at_unix"),
            age_s=f.number("age_s"),
            error=f.text("error"),
            raw=body,
        )
