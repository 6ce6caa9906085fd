"""An elastic-EP operation as vLLM's API server reports it (pure; HTTP and in-process mode).

vLLM 0.33 answers ``POST /is_scaling_elastic_ep`` (no dev mode needed; served wherever the
server serves ``generate``) with ``{"is_scaling_elastic_ep": bool, "phase": .., "epoch": str |
null, "error": str | null, "requested_data_parallel_size": int | null}``: the external
elastic-EP operation's status from its shared store (``ExternalElasticEPScalePhase``: ``idle``,
``preparing``, ``committing``, ``completed``, ``failed``; ``get_status``) or, without external
elastic EP, the process-local flag as ``committing`` (true) or ``idle`` (false), the other keys
null. vLLM 0.32 answers ``{"is_scaling_elastic_ep": bool}`` alone: read the way 0.33 reads its
own flag. In-process mode reads the same status map from ``engine_client.
get_external_elastic_ep_status()`` (no ``is_scaling_elastic_ep`` in it: taken from the phase,
as vLLM's route does).

``read_status`` is the one rule: a phase string this exporter does not know is ``other`` (the
string kept, cut, in ``reported_phase``); strings are cut by ``bound_text``; an answer that is
not such a map, or a key of the wrong type, is ``UnreadableAnswer`` (a ``ValueError`` whose
message says what, never echoing a long value). ``ElasticEpRead`` is what the exporter knows of
one API server (its target) after its last read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from exporter.protocol.strings import bound_text

IDLE, PREPARING, COMMITTING, COMPLETED, FAILED = (
    "idle",
    "preparing",
    "committing",
    "completed",
    "failed",
)
#: A phase string this exporter does not know (a later vLLM's).
OTHER = "other"
#: vLLM 0.33's phases (``ExternalElasticEPScalePhase`` values).
KNOWN_PHASES = (IDLE, PREPARING, COMMITTING, COMPLETED, FAILED)
#: Every value of ``vllm_dp_elastic_ep_operation{phase}``.
ELASTIC_EP_PHASES = (*KNOWN_PHASES, OTHER)
#: The phases in which vLLM's route says it is scaling (serving paused).
SCALING_PHASES = frozenset({PREPARING, COMMITTING})
#: The most of one answer read: vLLM's is under 300 bytes (its strings are an epoch's UUID and
#: an error text); a longer one is refused unread.
MAX_ELASTIC_EP_ANSWER = 64 << 10
#: ``requested_data_parallel_size`` read as a size from 1 to this (DP ranks fit in two bytes).
MAX_DATA_PARALLEL_SIZE = 1 << 16
#: An epoch shown as ``vllm_dp_elastic_ep_epoch`` only when it is a whole number of at most
#: 15 digits (exact as a float sample); vLLM's own are UUIDs (``/status`` only).
_INTEGER_EPOCH = re.compile(r"[0-9]{1,15}\Z")


class UnreadableAnswer(ValueError):
    """An answer that does not say an operation's status; the message says why."""


@dataclass(frozen=True, slots=True)
class ElasticEpOperation:
    """One API server's elastic-EP operation as it last said it."""

    #: One of ``ELASTIC_EP_PHASES``.
    phase: str
    epoch: str | None = None
    error: str | None = None
    requested_data_parallel_size: int | None = None
    #: vLLM's ``is_scaling_elastic_ep``: serving paused for the operation.
    scaling: bool = False
    #: For ``other``: the phase string it sent (cut); None otherwise.
    reported_phase: str | None = None

    @property
    def epoch_number(self) -> int | None:
        """The epoch as a whole number, when it is one (``vllm_dp_elastic_ep_epoch``)."""
        epoch = self.epoch
        return int(epoch) if epoch is not None and _INTEGER_EPOCH.match(epoch) else None


@dataclass(frozen=True, slots=True)
class ElasticEpRead:
    """What the exporter knows of one API server's operation (``target``) after its last read:
    the operation, or the ``problem`` that kept it from knowing (``supported`` False: the
    server has no such route or method, asked again rarely)."""

    target: str
    operation: ElasticEpOperation | None = None
    problem: str | None = None
    #: Unix time of the answer (or of the failure); None: not asked yet.
    read_at_unix: float | None = None
    supported: bool = True


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _text(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise UnreadableAnswer(f"{key} is {_kind(value)}, not a string or null")
    return None if value is None else bound_text(value)


def _size(doc: dict[str, Any]) -> int | None:
    value = doc.get("requested_data_parallel_size")
    if value is None:
        return None
    if type(value) is not int or not 1 <= value <= MAX_DATA_PARALLEL_SIZE:
        shown = repr(value) if type(value) is int else _kind(value)
        raise UnreadableAnswer(
            f"requested_data_parallel_size is {shown[:24]}, not a size from 1 to "
            f"{MAX_DATA_PARALLEL_SIZE} or null"
        )
    return value


def read_status(doc: Any) -> ElasticEpOperation:
    """One status map (vLLM 0.33's answer or ``get_external_elastic_ep_status()``'s value,
    or vLLM 0.32's ``{"is_scaling_elastic_ep": bool}``) as an operation."""
    if not isinstance(doc, dict):
        raise UnreadableAnswer(f"answer is {_kind(doc)}, not a JSON object")
    flag = doc.get("is_scaling_elastic_ep")
    if flag is not None and type(flag) is not bool:
        raise UnreadableAnswer(f"is_scaling_elastic_ep is {_kind(flag)}, not a boolean")
    raw = doc.get("phase")
    if raw is None:  # vLLM 0.32 (or 0.33 without external elastic EP): the flag alone
        if flag is None:
            raise UnreadableAnswer("answer has neither phase nor is_scaling_elastic_ep")
        phase, reported = (COMMITTING if flag else IDLE), None
    elif not isinstance(raw, str):
        raise UnreadableAnswer(f"phase is {_kind(raw)}, not a string")
    elif raw in KNOWN_PHASES:
        phase, reported = raw, None
    else:
        phase, reported = OTHER, bound_text(raw)
    return ElasticEpOperation(
        phase=phase,
        epoch=_text(doc, "epoch"),
        error=_text(doc, "error"),
        requested_data_parallel_size=_size(doc),
        scaling=flag if flag is not None else phase in SCALING_PHASES,
        reported_phase=reported,
    )


def read_answer(body: bytes) -> ElasticEpOperation:
    """A 200 answer's body (at most ``MAX_ELASTIC_EP_ANSWER`` bytes) as an operation."""
    if len(body) > MAX_ELASTIC_EP_ANSWER:
        raise UnreadableAnswer(f"answer longer than {MAX_ELASTIC_EP_ANSWER} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise UnreadableAnswer("answer is not JSON (or nested too deeply)") from None
    return read_status(doc)


def error_detail(body: bytes) -> str | None:
    """The message of an error answer, cut: vLLM's envelope (``{"error": {"message": ..}}``:
    its 503 "External Elastic EP status is temporarily unavailable"), Starlette's
    ``{"detail": ..}``, or ``{"error": ..}`` (vLLM's scaling middleware); None without one."""
    if len(body) > MAX_ELASTIC_EP_ANSWER:
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    found = doc.get("error", doc.get("detail"))
    if isinstance(found, dict):
        found = found.get("message")
    return bound_text(found) if isinstance(found, str) else None
