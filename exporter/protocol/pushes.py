"""What engines send unasked: utility outputs with vLLM's reserved negative call ids (pure).

vLLM 0.33 (``vllm/v1/engine/__init__.py``) reserves ``EEP_NOTIFICATION_CALL_ID = -1`` for
elastic-EP membership events (``[type, dp_rank]``: ``RECONFIGURE_FINISHED``,
``SHUTDOWN_COMPLETE``) and ``FT_STATUS_CALL_ID = -2`` for the fault-tolerance sentinel's health
pushes (``{"id": engine_index, "status": "healthy|unhealthy|dead", "fault_info": ...}``, the last
key only while unhealthy). Both go to client 0, and the exporter's own calls never use a
negative id, so a negative id is never a reply ([protocol.md](../../docs/protocol.md) C.6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.error import ProtocolError
from exporter.protocol.strings import bound_text

EEP_NOTIFICATION_CALL_ID = -1
FT_STATUS_CALL_ID = -2
#: The sentinel's statuses (``EngineStatusType`` names, lower case).
FT_STATUSES = ("healthy", "unhealthy", "dead")
#: Statuses that mean the rank cannot serve.
FT_FAULTY = frozenset({"unhealthy", "dead"})
#: vLLM 0.33's ``EEPNotificationType`` values.
EEP_EVENTS = ("RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE")
#: How a push is counted (``vllm_dp_engine_pushes_total{kind}``).
PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER = "fault_tolerance_status", "elastic_ep", "other"
PUSH_KINDS = (PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER)
MAX_FAULT_INFO = 256


@dataclass(frozen=True, slots=True)
class FaultStatus:
    """An engine's last fault-tolerance status, and since when the exporter knows it."""

    status: str
    fault_info: str | None
    since_unix: float

    @property
    def faulty(self) -> bool:
        return self.status in FT_FAULTY


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


def _ft_rank_status(value: Any) -> tuple[int, str]:
    """(rank, status) of one status entry as vLLM builds it (the sentinel's push, and each value
    of the front end's ``_engine_status``); another shape raises ``ProtocolError``."""
    if not isinstance(value, dict):
        raise ProtocolError("bad_push", "fault-tolerance status is not a map")
    rank, status = value.get("id"), value.get("status")
    if type(rank) is not int or not 0 <= rank < 0x10000:
        raise ProtocolError("bad_push", f"fault-tolerance status for engine {_kind(rank)}")
    if status not in FT_STATUSES:
        raise ProtocolError("bad_push", f"unknown fault-tolerance status {_kind(status)}")
    return rank, status


def decode_ft_status(value: Any, engine_index: int) -> tuple[str, str | None]:
    """(status, fault_info) of one sentinel push from ``engine_index``'s connection. A push
    naming another engine, or of another shape, raises ``ProtocolError``; a fault_info that is
    not a string is shown as its repr (the status itself is what counts)."""
    rank, status = _ft_rank_status(value)
    if rank != engine_index:
        raise ProtocolError(
            "bad_push", f"fault-tolerance status for engine {rank} on engine {engine_index}"
        )
    info = value.get("fault_info")
    if info is not None and not isinstance(info, str):
        info = repr(info)
    return status, info[:MAX_FAULT_INFO] if info is not None else None


def decode_ft_entry(value: Any) -> tuple[int, str, str | None]:
    """(rank, status, fault_info) of one entry of the front end's table (``_engine_status``,
    in-process mode; ``GET /fault_tolerance/status``, HTTP mode): fault_info cut with the
    marker, a failed recovery's ``ft_error`` appended. Another shape, or text that is not a
    string, raises ``ProtocolError`` (the caller drops the entry or the whole answer)."""
    rank, status = _ft_rank_status(value)
    info, error = value.get("fault_info"), value.get("ft_error")
    if not all(v is None or isinstance(v, str) for v in (info, error)):
        raise ProtocolError("bad_push", f"engine {rank}: fault_info or ft_error is not a string")
    text = bound_text(info) if info else None
    if error:
        text = f"{text or status}, recovery failed: {bound_text(error, 128)}"
    return rank, status, text


def _kind(value: Any) -> str:
    return repr(bound_text(value, 32)) if isinstance(value, str) else type(value).__name__


def decode_eep_notification(value: Any) -> tuple[str, int]:
    """(event, dp_rank) of one elastic-EP notification; another shape raises."""
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    event, rank = value
    if not isinstance(event, str) or type(rank) is not int:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    return event[:64], rank


def encode_ft_status_value(
    engine_index: int, status: str, fault_info: str | None = None
) -> dict[str, Any]:
    """The sentinel's payload exactly as vLLM 0.33's ``_push_status`` builds it (simulators)."""
    payload: dict[str, Any] = {"id": engine_index, "status": status}
    if status == "unhealthy":
        payload["fault_info"] = fault_info
    return payload
