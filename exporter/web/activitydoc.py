"""Each engine's ``activity`` and ``progress`` entries of ``/status`` (docs/activity.md): what
the last poll's snapshot says the rank is doing, as JSON (pure, no call to any engine)."""

from __future__ import annotations

from typing import Any

from exporter.client.fleet import EngineOutcome
from exporter.fleetstate.invariants import HAS_WORK
from exporter.fleetstate.snapshot import EngineSnapshot


def activity_json(e: EngineSnapshot) -> dict[str, Any]:
    """What ``e`` is doing: ``has_work`` (this poll's read of it, or what its request counts
    told a listening poll: ``has_work_read``) and its running and waiting requests (null: not
    known in this attach mode, or not this poll)."""
    counts = e.requests
    said = e.outcomes.get(HAS_WORK.method)
    return {
        "has_work": e.has_work,
        "has_work_read": None if e.has_work is None or said is None else _work_read(said),
        "running": None if counts is None else counts.running,
        "waiting": None if counts is None else counts.waiting,
        "drained": e.drained if e.has_work is not None else None,
    }


def _work_read(said: EngineOutcome) -> str:
    """How a poll's ``has_work`` came: ``asked`` (the mode's read of it: a utility call, or
    HTTP mode's ``/metrics``) or ``told`` (by the rank's live request counts, nothing asked)."""
    return "told" if said.told else "asked"


def progress_json(e: EngineSnapshot) -> dict[str, Any] | None:
    """The tokens ``e`` computed and when they last grew (null: no source tells in this attach
    mode, or not this poll; docs/activity.md)."""
    made = e.progress
    if made is None:
        return None
    return {**made.json(), "age_seconds": round(e.progress_age_s or 0.0, 3)}
