"""One rank's row for routers, from a snapshot (pure): what ``/watch`` sends and the ZMQ load
publisher publishes.

A row is what a router needs to decide whether to send a rank traffic: its state, routable and
why not, its running and waiting requests, its progress, its fault-tolerance status, its weight
version. Whether a row *changed* is decided by ``RankRow.key``, which leaves out what moves
with the clock alone (the poll number, the progress age, the seconds in "hung: no answer for
12 s"): a hung rank is one event when it turns hung, not one per poll.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exporter.fleetstate.activity import routability
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot

#: Reasons whose text carries a duration: only the part before ``:`` decides a change.
TIMED_REASONS = ("hung:", "stalled:", "stale:")
#: Fields sent but no change of their own: the reasons (compared by ``reason_key``), and the
#: progress, which grows every poll a rank computes (its stall is a state of its own).
UNKEYED = frozenset({"reasons", "progress_tokens", "last_progress_unix"})
#: A rank that left the fleet (an elastic-EP scale-down, a target removed): its last row.
GONE = "gone"


def reason_key(reason: str) -> str:
    """``reason`` without the duration it carries (``"hung: no answer for 12 s"`` → ``"hung"``)."""
    for prefix in TIMED_REASONS:
        if reason.startswith(prefix):
            return prefix[:-1]
    return reason


@dataclass(frozen=True, slots=True)
class RankRow:
    """One rank's row: ``fields`` in the order they are sent, ``key`` what a change is."""

    engine: str
    fields: Mapping[str, Any]
    key: tuple[Any, ...]

    @property
    def routable(self) -> bool:
        return bool(self.fields.get("routable"))

    def data(self, poll: int, unix: float, progress_age_s: float | None) -> bytes:
        """The row as one line of JSON, with what moves with the clock (``poll``, ``unix``,
        ``progress_age_seconds``) filled in at the time it is sent."""
        body = {
            **self.fields,
            "progress_age_seconds": progress_age_s,
            "poll": poll,
            "unix": round(unix, 3),
        }
        return json.dumps(body, separators=(",", ":")).encode()


def rank_row(e: EngineSnapshot) -> RankRow:
    """``e``'s row (``exporter.fleetstate.activity.routability`` decides routable)."""
    verdict = routability(e)
    counts = e.requests
    progress = e.progress
    ft = e.detail.fault_status
    fields: dict[str, Any] = {
        "engine": e.engine,
        "state": e.state,
        "routable": verdict.routable,
        "reasons": list(verdict.reasons),
        "connected": e.detail.connected,
        "up": e.up,
        "hung": e.hung,
        "stalled": e.stalled,
        "sleeping": e.sleeping,
        "paused": e.paused,
        "weight_version": e.weight_version,
        "has_work": e.has_work,
        "running": None if counts is None else counts.running,
        "waiting": None if counts is None else counts.waiting,
        "drained": e.drained if e.has_work is not None else None,
        "progress_tokens": None if progress is None else progress.tokens,
        "last_progress_unix": None if progress is None else progress.last_progress_unix,
        "fault_tolerance": None if ft is None else ft.status,
    }
    reasons = tuple(reason_key(r) for r in verdict.reasons)
    key = tuple(v for k, v in fields.items() if k not in UNKEYED) + reasons
    return RankRow(e.engine, fields, key)


def gone_row(engine: str) -> RankRow:
    """The row of a rank that is no longer part of the fleet: never routable."""
    fields: dict[str, Any] = {
        "engine": engine,
        "state": GONE,
        "routable": False,
        "reasons": ["no longer part of the fleet"],
    }
    return RankRow(engine, fields, (GONE,))


def rank_rows(snap: FleetSnapshot) -> dict[str, RankRow]:
    """Every rank's row in ``snap``, in the snapshot's order."""
    return {e.engine: rank_row(e) for e in snap.engines}


def progress_ages(snap: FleetSnapshot) -> dict[str, float | None]:
    """Each rank's seconds since its tokens last grew, as the snapshot computed them."""
    return {
        e.engine: None if e.progress_age_s is None else round(e.progress_age_s, 3)
        for e in snap.engines
    }
