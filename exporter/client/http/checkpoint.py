"""vLLM 0.34's checkpoint routes as HTTP mode reads them (pure; ``exporter.protocol.checkpoint``).

``GET /checkpoint/status`` answers every state with its body ``{"state": ..., "error": ...}``
(``error`` left out when None) and a status that says it too: 200 only while ``prepared``, 503
while running, preparing or restoring, 500 once failed. So each of these three is an answer,
read from the body; anything else (or a body that is no state) is a failure. ``POST
/checkpoint/prepare?mode=`` answers 200 once started, 400 with the state and why it will not
prepare (the value is then that text: a refusal, as ``checkpoint_prepare`` returns it);
``POST /checkpoint/restore`` 200, or 400 with the state it cannot restore from. The routes are
mounted only with ``--enable-sleep-mode`` and from vLLM 0.34 on: a 404 is "unsupported".
A server with several engines answers vLLM's own aggregate (failed if any failed, the common
state if all agree, else preparing or restoring): which rank is behind is not said there.
"""

from __future__ import annotations

import json
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.protocol.checkpoint import read_checkpoint
from exporter.protocol.strings import bound_text

#: The statuses ``GET /checkpoint/status`` answers a state with.
STATUS_ANSWERS = frozenset({200, 500, 503})
CHECKPOINT_METHODS = frozenset({"checkpoint_state", "checkpoint_prepare", "checkpoint_restore"})


def state_body(body: bytes) -> tuple[str, str | None] | None:
    """``(state, error)`` of a checkpoint route's body, or None when it says none (bounded:
    the read limit already bounds the body; one linear C parse)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    read = read_checkpoint([data.get("state"), error])
    if read is None:
        return None
    state, text = read
    return state, None if text is None else bound_text(text)


def interpret_checkpoint(
    label: str, method: str, status: int, body: bytes, duration_s: float | None
) -> EngineOutcome | None:
    """One checkpoint route's answer as an outcome, or None where the shared rules read it
    (a 404, a status these routes do not answer with a state)."""
    read = state_body(body)
    if read is None:
        return None
    state, error = read
    value: Any
    if method == "checkpoint_state" and status in STATUS_ANSWERS:
        value = [state, error]
    elif method == "checkpoint_prepare" and status in (200, 400):
        value = None if status == 200 else (error or f"the checkpoint state is {state}")
    elif method == "checkpoint_restore" and status == 200:
        value = None
    elif method == "checkpoint_restore" and status == 400:
        why = f"cannot restore while the checkpoint state is {state}" + (
            f" ({error})" if error else ""
        )
        return EngineOutcome(label, Outcome.FAILED, error=bound_text(why), duration_s=duration_s)
    else:
        return None
    return EngineOutcome(label, Outcome.OK, value, duration_s=duration_s)
