"""What engines send unasked: utility outputs with vLLM's reserved negative call ids (pure).

vLLM 0.33 (``vllm/v1/engine/__init__.py``) reserves ``EEP_NOTIFICATION_CALL_ID = -1`` for
elastic-EP membership events (``[type, dp_rank]``: ``RECONFIGURE_FINISHED``,
``SHUTDOWN_COMPLETE``; the sender's, whatever rank its parallel config names) and
``FT_STATUS_CALL_ID = -2`` for the fault-tolerance sentinel's health pushes (``{"id":
engine_index, "status": "healthy|unhealthy|dead", "fault_info": ...}``, the last key only while
unhealthy). Both go to client 0, and the exporter's own calls never use a
negative id, so a negative id is never a reply ([protocol.md](../../docs/protocol.md) C.6).
``read_rank_status`` is the one rule every mode reads vLLM's status shape by (pushes, the front
end's table in-process, ``GET /fault_tolerance/status`` in HTTP mode): the status is read as a
string; vLLM's open PR #41438 adds ``paused`` and ``recovering`` (kept as they are), any other
string is ``other`` (the string itself in ``fault_info``, never a label), and a status that is no
string at all is ``unknown`` (unreadable, counted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.error import ProtocolError
from exporter.protocol.strings import MAX_ENGINE_STRING, bound_text

EEP_NOTIFICATION_CALL_ID = -1
FT_STATUS_CALL_ID = -2
#: The one status that means the rank may serve.
FT_HEALTHY = "healthy"
#: vLLM 0.33's sentinel statuses (``EngineStatusType`` names, lower case).
FT_STATUSES_033 = (FT_HEALTHY, "unhealthy", "dead")
#: Every status read as itself: vLLM 0.33's, the two vLLM's open PR #41438 adds (a rank held
#: still while the fleet recovers, a rank being recovered), and vLLM 0.34's ``diagnosing`` (a
#: faulted rank whose workers' all2all mask is being read before it goes ``unhealthy``).
FT_STATUSES = (*FT_STATUSES_033, "paused", "recovering", "diagnosing")
#: A status string the exporter does not know (a later vLLM's): the string itself goes to
#: ``fault_info``, never to a label (the label's values stay these few). Readable: not counted.
FT_OTHER = "other"
#: What the exporter records for a rank whose status it cannot read (an entry or push of
#: another shape, a status that is no string) or does not know (after a restart without a
#: record): never healthy.
FT_UNKNOWN = "unknown"
#: Every value of ``vllm_dp_engine_fault_tolerance_status{status}``.
FT_STATE_VALUES = (*FT_STATUSES, FT_OTHER, FT_UNKNOWN)
#: Statuses that mean the rank cannot be trusted to serve: every one but healthy.
FT_FAULTY = frozenset(FT_STATE_VALUES) - {FT_HEALTHY}
#: vLLM 0.33's ``EEPNotificationType`` values.
EEP_EVENTS = ("RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE")
#: DP ranks an engine can have (its identity is two bytes: docs/protocol.md A.2).
MAX_RANKS = 0x10000
#: How a push is counted (``vllm_dp_engine_pushes_total{kind}``).
PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER = "fault_tolerance_status", "elastic_ep", "other"
PUSH_KINDS = (PUSH_FT_STATUS, PUSH_EEP, PUSH_OTHER)
#: ``fault_info`` kept at most: UTF-8 bytes, the cut marker included (``bound_text``).
MAX_FAULT_INFO = MAX_ENGINE_STRING
#: ``fault_info`` of a status the exporter could not read starts with this.
UNREADABLE = "unreadable status: "
#: An ``other`` status string shown in ``fault_info``: UTF-8 bytes kept before its repr
#: (control characters escaped), and the most that repr may take.
MAX_OTHER_STATUS = 64
#: vLLM 0.34's ``mask`` of an ``unhealthy`` push (the union of its workers' all2all masks, one
#: int32 per rank, 0 or 1 in practice): entries read at most, and shown at most in
#: ``fault_info``.
MAX_MASK = 65536
MASK_SHOWN = 64
#: The front end's own recovery state of a rank (vLLM 0.34's ``ft_state`` in its cached entry).
FT_FRONT_END_STATES = ("recovering", "failed")


@dataclass(frozen=True, slots=True)
class FaultStatus:
    """An engine's last fault-tolerance status, and since when the exporter knows it."""

    status: str
    fault_info: str | None
    since_unix: float

    @property
    def faulty(self) -> bool:
        """Not healthy: anything but ``healthy`` (fail closed)."""
        return self.status != FT_HEALTHY


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
    """An elastic-EP notification, the sender's: which event, the DP rank of the engine whose
    connection carried it (``dp_rank``), when, and the DP rank the notification named
    (``reported_rank``: vLLM's ``parallel_config.data_parallel_rank``, 0 on a dense engine, a
    MoE engine's new rank after a reconfiguration; None where not reported)."""

    event: str
    dp_rank: int
    engine: str
    received_unix: float
    reported_rank: int | None = None


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
    return rank if type(rank) is int and 0 <= rank < MAX_RANKS else None


def read_rank_status(value: Any, rank: int) -> RankStatus:
    """The one rule for vLLM's status shape (the sentinel's push, each entry of the front end's
    ``_engine_status`` and of ``GET /fault_tolerance/status``), for ``rank``: the status is what
    matters, read as a string: one of ``FT_STATUSES`` is itself, any other string ``FT_OTHER``
    (the string, cut short and escaped, first in ``fault_info``). ``fault_info`` (and a failed
    recovery's ``ft_error``) is shown as text, its repr when it is not a string, cut by the one
    rule for engine strings. A value whose status is no string (or that is no map) cannot be
    read: ``FT_UNKNOWN`` with the reason in ``problem``, never healthy, never dropped. The
    caller has checked that the value belongs to ``rank``."""
    if not isinstance(value, dict):
        return unreadable(rank, f"not a map but {_kind(value)}")
    raw = value.get("status")
    if not isinstance(raw, str):
        return unreadable(rank, f"fault-tolerance status is not text but {_kind(raw)}")
    status = raw if raw in FT_STATUSES else FT_OTHER
    info = _text(value.get("fault_info"))
    if status == FT_OTHER:
        named = f"status {_other_status(raw)}"
        info = f"{named}: {info}" if info else named
    for extra in (_mask_text(value.get("mask")), _front_end_text(value.get("ft_state"))):
        if extra:
            info = f"{info or status}; {extra}"
    error = _text(value.get("ft_error"))
    if error:
        info = f"{info or status}, recovery failed: {bound_text(error, 128)}"
    return RankStatus(rank, status, bound_text(info, MAX_FAULT_INFO) if info else None)


def _mask_text(mask: Any) -> str | None:
    """vLLM 0.34's all2all ``mask`` as ``fault_info`` shows it: its first ``MASK_SHOWN``
    entries, then how many in all; a string of bits when every entry is 0 or 1, the numbers
    otherwise (vLLM sends an int32 tensor's ``tolist()``: DeepEP fills it, the exporter does not
    interpret it). ``mask unreadable`` when it is not a list of at most ``MAX_MASK`` int32
    integers. None without one."""
    if mask is None:
        return None
    if (
        not isinstance(mask, list)
        or len(mask) > MAX_MASK
        or not all(type(v) is int and -(1 << 31) <= v < 1 << 31 for v in mask)
    ):
        return "mask unreadable"
    shown = mask[:MASK_SHOWN]
    if all(v in (0, 1) for v in shown):
        text = "".join(map(str, shown))
    else:
        text = "[" + ", ".join(map(str, shown)) + "]"
    more = f"... ({len(mask)} ranks)" if len(mask) > MASK_SHOWN else ""
    return f"all2all mask {text}{more}"


def _front_end_text(state: Any) -> str | None:
    """The front end's own recovery state of the rank (vLLM 0.34's ``ft_state``)."""
    if state is None:
        return None
    if state in FT_FRONT_END_STATES:
        return f"front end: {state}"
    return f"front end: {_other_status(state) if isinstance(state, str) else _kind(state)}"


def _other_status(raw: str) -> str:
    """A status string the exporter does not know, as ``fault_info`` shows it: its first
    ``MAX_OTHER_STATUS`` bytes (with the cut marker), quoted, control characters escaped."""
    return bound_text(repr(bound_text(raw, MAX_OTHER_STATUS)), 2 * MAX_OTHER_STATUS)


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


def decode_eep_notification(value: Any) -> tuple[str, int]:
    """(event, DP rank it names) of one elastic-EP notification: one of vLLM's known events and
    a rank an engine can have. The rank is not the sender's check: vLLM sends its config's
    ``data_parallel_rank`` (0 on every dense engine, a renumbered MoE engine's new rank), and the
    connection says who sent it. Another shape, an unknown event or an impossible rank raises
    ``ProtocolError``."""
    if not isinstance(value, list) or len(value) != 2:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    event, rank = value
    if not isinstance(event, str) or type(rank) is not int:
        raise ProtocolError("bad_push", "elastic-EP notification is not [type, dp_rank]")
    if event not in EEP_EVENTS:
        raise ProtocolError("bad_push", f"unknown elastic-EP event {_kind(event)}")
    if not 0 <= rank < MAX_RANKS:
        raise ProtocolError("bad_push", f"elastic-EP {event} names DP rank {rank}")
    return event, rank


def encode_ft_status_value(
    engine_index: int, status: str, fault_info: str | None = None
) -> dict[str, Any]:
    """The sentinel's payload exactly as vLLM 0.33's ``_push_status`` builds it (simulators):
    ``fault_info`` only while unhealthy. Any other status string (``paused``, ``recovering``,
    one no vLLM has) is sent as given, with ``fault_info`` when one is given."""
    payload: dict[str, Any] = {"id": engine_index, "status": status}
    if status == "unhealthy" or (status not in FT_STATUSES_033 and fault_info is not None):
        payload["fault_info"] = fault_info
    return payload
