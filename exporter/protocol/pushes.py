"""What engines send unasked: utility outputs with vLLM's reserved negative call ids (pure).

vLLM 0.33 (``vllm/v1/engine/__init__.py``) reserves ``EEP_NOTIFICATION_CALL_ID = -1`` for
elastic-EP membership events (``[type, dp_rank]``: ``RECONFIGURE_FINISHED``,
``SHUTDOWN_COMPLETE``) and ``FT_STATUS_CALL_ID = -2`` for the fault-tolerance sentinel's health
pushes (``{"id": engine_index, "status": "healthy|unhealthy|dead", "fault_info": ...}``, the last
key only while unhealthy). Both go to client 0, and the exporter's own calls never use a
negative id, so a negative id is never a reply ([protocol.md](../../docs/protocol.md) C.6).
``read_rank_status`` is the one rule every mode reads vLLM's status shape by (pushes, the front
end's table in-process, ``GET /fault_tolerance/status`` in HTTP mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.error import ProtocolError
from exporter.protocol.strings import MAX_ENGINE_STRING, bound_text

EEP_NOTIFICATION_CALL_ID = -1
FT_STATUS_CALL_ID = -2
#: The sentinel's statuses (``EngineStatusType`` names, lower case).
FT_STATUSES = ("healthy", "unhealthy", "dead")
#: What the exporter records for a rank whose status it cannot read (an entry or push of
#: another shape, a status vLLM 0.33 does not have) or does not know (after a restart without
#: a record): never healthy.
FT_UNKNOWN = "unknown"
#: Every value of ``vllm_dp_engine_fault_tolerance_status{status}``, best first.
FT_STATE_VALUES = (*FT_STATUSES, FT_UNKNOWN)
#: Statuses that mean the rank cannot be trusted to serve.
FT_FAULTY = frozenset({"unhealthy", "dead", FT_UNKNOWN})
#: vLLM 0.33's ``EEPNotificationType`` values.
EEP_EVENTS = ("RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE")
#: How a push is counted (``vllm_dp_engine_pushes_total{kind}``).
PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER = "fault_tolerance_status", "elastic_ep", "other"
PUSH_KINDS = (PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER)
#: ``fault_info`` kept at most: UTF-8 bytes, the cut marker included (``bound_text``).
MAX_FAULT_INFO = MAX_ENGINE_STRING
#: ``fault_info`` of a status the exporter could not read starts with this.
UNREADABLE = "unreadable status: "


@dataclass(frozen=True, slots=True)
class FaultStatus:
    """An engine's last fault-tolerance status, and since when the exporter knows it."""

    status: str
    fault_info: str | None
    since_unix: float

    @property
    def faulty(self) -> bool:
        """Not healthy: unhealthy, dead, or unknown (fail closed)."""
        return self.status in FT_FAULTY


@dataclass(frozen=True, slots=True)
class RankStatus:
    """One rank's status as read from vLLM's shape; ``problem`` says why it could not be read
    (then ``status`` is ``FT_UNKNOWN``): the caller counts it, never drops it."""

    rank: int
    status: str
    fault_info: str | None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """An elastic-EP notification: which event, the DP rank that sent it, when."""

    event: str
    dp_rank: int
    engine: str
    received_unix: float


def push_kind(call_id: int) -> str:
    """How a push with this (negative) call id is counted."""
    if call_id == FT_STATUS_CALL_ID:
        return PUSH_FT_STATUS
    if call_id == EEP_NOTIFICATION_CALL_ID:
        return PUSH_EEP
    return PUSH_OTHER


def entry_rank(value: Any) -> int | None:
    """The rank one status entry names (``id``), or None when it names none readable."""
    rank = value.get("id") if isinstance(value, dict) else None
    return rank if type(rank) is int and 0 <= rank < 0x10000 else None


def read_rank_status(value: Any, rank: int) -> RankStatus:
    """The one rule for vLLM's status shape (the sentinel's push, each entry of the front end's
    ``_engine_status`` and of ``GET /fault_tolerance/status``), for ``rank``: the status is what
    matters; ``fault_info`` (and a failed recovery's ``ft_error``) is shown as text, its repr
    when it is not a string, cut by the one rule for engine strings. A value whose status
    cannot be read is ``FT_UNKNOWN`` with the reason in ``problem``: never healthy, never
    dropped. The caller has checked that the value belongs to ``rank``."""
    if not isinstance(value, dict):
        return unreadable(rank, f"not a map but {_kind(value)}")
    status = value.get("status")
    if status not in FT_STATUSES:
        return unreadable(rank, f"unknown fault-tolerance status {_kind(status)}")
    info = _text(value.get("fault_info"))
    error = _text(value.get("ft_error"))
    if error:
        info = f"{info or status}, recovery failed: {bound_text(error, 128)}"
    return RankStatus(rank, status, bound_text(info, MAX_FAULT_INFO) if info else None)


def decode_ft_status(value: Any, engine_index: int) -> RankStatus:
    """One sentinel push from ``engine_index``'s connection (``read_rank_status``). A push that
    names another engine raises ``ProtocolError`` (no engine can set another's status); one
    that names no readable engine is the sender's own, unreadable."""
    rank = entry_rank(value)
    if rank is not None and rank != engine_index:
        raise ProtocolError(
            "bad_push", f"fault-tolerance status for engine {rank} on engine {engine_index}"
        )
    if rank is None and isinstance(value, dict):
        return unreadable(engine_index, f"names engine {_kind(value.get('id'))}")
    return read_rank_status(value, engine_index)


def unreadable(rank: int, why: str) -> RankStatus:
    return RankStatus(rank, FT_UNKNOWN, UNREADABLE + why, problem=why)


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    try:
        return bound_text(repr(value)[: 4 * MAX_FAULT_INFO])
    except (ValueError, RecursionError):  # an int past the digit limit, deep nesting
        return type(value).__name__


def _kind(value: Any) -> str:
    return repr(bound_text(value, 32)) if isinstance(value, str) else type(value).__name__


def decode_eep_notification(value: Any, engine_index: int) -> tuple[str, int]:
    """(event, dp_rank) of one elastic-EP notification from ``engine_index``'s connection: one
    of vLLM's known events about the sender's own rank (vLLM 0.33's engine sends its own
    ``dp_rank``); another shape, an unknown event or another rank raises ``ProtocolError``."""
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    event, rank = value
    if not isinstance(event, str) or type(rank) is not int:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    if event not in EEP_EVENTS:
        raise ProtocolError("bad_push", f"unknown elastic-EP event {_kind(event)}")
    if rank != engine_index:
        raise ProtocolError(
            "bad_push", f"elastic-EP {event} for DP rank {rank} on engine {engine_index}"
        )
    return event, rank


def encode_ft_status_value(
    engine_index: int, status: str, fault_info: str | None = None
) -> dict[str, Any]:
    """The sentinel's payload exactly as vLLM 0.33's ``_push_status`` builds it (simulators)."""
    payload: dict[str, Any] = {"id": engine_index, "status": status}
    if status == "unhealthy":
        payload["fault_info"] = fault_info
    return payload
