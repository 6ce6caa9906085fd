"""vLLM 0.34's process-checkpoint lifecycle per engine (pure): the states and how a reply reads.

``EngineCore.checkpoint_state()`` answers ``(state, error)``: ``state`` one of vLLM's
``CheckpointState`` (``running``, ``preparing``, ``prepared``, ``restoring``, ``failed``; a
``StrEnum``, so a plain string on the wire), ``error`` why the last prepare or restore failed, or
None. ``checkpoint_prepare(mode)`` answers None once the drain started, or a string saying why the
engine will not prepare (nothing changed); ``checkpoint_restore()`` answers None or raises.
vLLM's own DP answer (``DPLBAsyncMPClient.checkpoint_state_async``) is not strict; the exporter
reads every engine on its own. A state this release does not know is no state (fail closed).
"""

from __future__ import annotations

from typing import Any

RUNNING, PREPARING, PREPARED, RESTORING, FAILED = (
    "running",
    "preparing",
    "prepared",
    "restoring",
    "failed",
)
#: vLLM 0.34's ``CheckpointState`` values, in the order of one cycle.
CHECKPOINT_STATES = (RUNNING, PREPARING, PREPARED, RESTORING, FAILED)
#: What the gate's ``checkpoint=`` condition may ask for (the states an orchestrator waits on).
GATE_STATES = (PREPARED, RUNNING)
#: The longest error text kept (it reaches labels, /status and the gate's answer).
MAX_ERROR = 256


def read_checkpoint(value: Any) -> tuple[str, str | None] | None:
    """``(state, error)`` from one engine's ``checkpoint_state`` reply, or None when it is not
    one (not a pair, a state vLLM 0.34 does not name, an error that is not text)."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    state, error = value
    if not isinstance(state, str) or state not in CHECKPOINT_STATES:
        return None
    if error is not None and not isinstance(error, str):
        return None
    return state, error


def is_checkpoint(value: Any) -> bool:
    return read_checkpoint(value) is not None


def checkpoint_state_of(value: Any) -> str | None:
    """The state of a ``checkpoint_state`` reply (what a condition compares), None when it is
    no such reply: never equal to a state a condition asks for."""
    read = read_checkpoint(value)
    return read[0] if read is not None else None
