"""The ``GET /status`` document (schema ``docs/status.schema.json``, explained in docs/status.md).

Pure: a snapshot, the counters, the history ring and a clock reading in, one JSON-ready dict
out. Every invariant has the same shape in ``aggregate`` and in each engine's ``invariants``;
``schema_version`` changes only when a key is removed or changes meaning (new keys may appear
at any time).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

from exporter import __version__
from exporter.base.steps import Steps, every
from exporter.client.fleet import (
    REGISTRATION_KEYS,
    ElasticEpRead,
    EngineDetail,
    Outcome,
)
from exporter.client.observe import UnexpectedEngine
from exporter.client.pushes import MembershipEvent
from exporter.config.settings import ServeConfig
from exporter.control.fleetread import ALONE
from exporter.fleetstate.aggregate import ConsensusVerdict, FleetState
from exporter.fleetstate.history import FleetHistory
from exporter.fleetstate.invariants import INVARIANTS, READS, Invariant
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot
from exporter.metrics.catalog import RESET_OUTCOMES
from exporter.metrics.stats import LastAction, Stats
from exporter.web.activitydoc import activity_json, progress_json
from exporter.web.routabledoc import routable_json

SCHEMA_VERSION = 1
OUTCOMES = RESET_OUTCOMES


def verdict_json(
    verdict: ConsensusVerdict,
    supported: bool = True,
    unsupported: list[str] | None = None,
    engines: int | None = None,
) -> dict[str, Any]:
    """One invariant's verdict; ``outcome`` is its state, or ``unsupported`` when no engine
    can answer it (every one of the ``engines`` lacks the method, or the attach mode does not
    ask it): an older vLLM, not a fault."""
    lacking = unsupported or []
    nowhere = not supported or (engines is not None and 0 < engines <= len(lacking))
    consistent = {FleetState.CONSISTENT: True, FleetState.INCONSISTENT: False}.get(verdict.state)
    error = verdict.error
    by_engine = None
    if error is not None and error.engines is not None and error.values:
        by_engine = dict(zip(error.engines, error.values, strict=False))
    return {
        "state": verdict.state.value,
        "outcome": "unsupported" if nowhere else verdict.state.value,
        "value": verdict.value if verdict.state is FleetState.CONSISTENT else None,
        "consistent": consistent,
        "supported": supported,
        "error": str(error) if error else None,
        "values": error.values if error else None,
        "by_engine": by_engine,
        "missing": list(verdict.missing),
        "unsupported": lacking,
    }


def invariant_json(e: EngineSnapshot, inv: Invariant) -> dict[str, Any]:
    """One engine's answer for one invariant (``outcome`` null: not asked)."""
    o = e.outcomes.get(inv.method)
    if inv.method in e.unsupported:
        return {"value": None, "outcome": "unsupported", "error": None, "values": None}
    if o is None:
        return {"value": None, "outcome": None, "error": None, "values": None}
    return {
        "value": e.value(inv),
        "outcome": o.outcome.value,
        "error": o.error,
        "values": list(o.values) if o.values else None,
    }


def kv_events_json(detail: EngineDetail) -> dict[str, Any] | None:
    """The engine's KV-events publisher as registered, and where to connect to it."""
    source = detail.kv_events
    if source is None:
        return None
    return {
        "publisher": source.publisher,
        "endpoint": source.endpoint,
        "replay_endpoint": source.replay_endpoint,
        "topic": source.topic,
        "target": source.target,
        "replay_target": source.replay_target,
        "note": source.note,
    }


def prefix_cache_json(stats: Stats | None, engine: str) -> dict[str, Any]:
    """The engine's confirmed prefix-cache resets since the exporter started."""
    last = stats.last_resets.get(engine) if stats is not None else None
    return {
        "confirmed_resets": stats.confirmed_resets.get(engine, 0) if stats is not None else 0,
        "last_reset_unix": last[0] if last else None,
        "last_reset_action": last[1] if last else None,
    }


def engine_json(
    e: EngineSnapshot, now: float | None = None, stats: Stats | None = None
) -> dict[str, Any]:
    since = None
    if now is not None and e.last_success_unix is not None:
        since = round(max(0.0, now - e.last_success_unix), 3)
    return {
        "engine": e.engine,
        "connected": e.detail.connected,
        "up": e.up,
        "state": e.state,
        "unresponsive_seconds": round(e.unresponsive_s, 3),
        "routable": routable_json(e),
        "activity": activity_json(e),
        "progress": progress_json(e),
        "last_success_unix": e.last_success_unix,
        "seconds_since_last_success": since,
        "vllm_version": e.detail.vllm_version,
        "front_end": e.detail.front_end,
        "rust_frontend_version": e.detail.rust_frontend_version,
        "enable_sleep_mode": e.detail.enable_sleep_mode,
        "address": e.detail.address,
        "handshakes": e.detail.handshakes,
        "unsupported": sorted(e.unsupported),
        "invariants": {inv.method: invariant_json(e, inv) for inv in INVARIANTS},
        "prefix_cache": prefix_cache_json(stats, e.engine),
        "kv_events": kv_events_json(e.detail),
        "registration": registration_json(e.detail),
        "fault_tolerance": fault_tolerance_json(e.detail),
        "membership_event": membership_json(e.detail.membership),
        "pushes": dict(e.detail.pushes),
    }


def registration_json(detail: EngineDetail) -> dict[str, Any]:
    """Every registration key the exporter keeps: null where the engine did not send it (an
    older vLLM) or the attach mode cannot know it (HTTP, in-process)."""
    facts = dict(detail.registration)
    return {key: facts.get(key) for key in REGISTRATION_KEYS}


def fault_tolerance_json(detail: EngineDetail) -> dict[str, Any] | None:
    ft = detail.fault_status
    if ft is None:
        return None
    return {"status": ft.status, "fault_info": ft.fault_info, "since_unix": ft.since_unix}


def membership_json(m: MembershipEvent | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        "event": m.event,
        "dp_rank": m.dp_rank,
        "reported_rank": m.reported_rank,
        "unix": m.received_unix,
    }


#: ``fault_tolerance.note`` where the attach mode cannot know (relay: pushes go to client 0).
FT_NOT_AVAILABLE = "not available in this attach mode (the engines push to the front end)"


def fleet_fault_tolerance_json(snap: FleetSnapshot) -> dict[str, Any]:
    """The fleet verdict: every rank that reported a fault-tolerance status is healthy; null
    (with a note) where the attach mode cannot know: unknown is never shown as healthy."""
    if not snap.fault_tolerance_known:
        return {
            "healthy": None,
            "faulty_engines": [],
            "reported_engines": [],
            "note": FT_NOT_AVAILABLE,
        }
    faulty = list(snap.faulty)
    return {
        "healthy": not faulty,
        "faulty_engines": faulty,
        "reported_engines": list(snap.fault_reported),
    }


#: An operation's keys in each ``elastic_ep_operations`` entry (null while not known).
ELASTIC_EP_KEYS = (
    "phase",
    "reported_phase",
    "scaling",
    "epoch",
    "error",
    "requested_data_parallel_size",
)


def elastic_ep_json(reads: tuple[ElasticEpRead, ...] | None) -> list[dict[str, Any]] | None:
    """Each API server's elastic-EP operation (null where the attach mode has none to ask)."""
    if reads is None:
        return None
    return [
        {
            "target": r.target,
            **{key: getattr(r.operation, key, None) for key in ELASTIC_EP_KEYS},
            "supported": r.supported,
            "read_at_unix": r.read_at_unix,
            "problem": r.problem,
        }
        for r in reads
    ]


def unexpected_json(
    unexpected: Mapping[str, UnexpectedEngine],
) -> list[dict[str, Any]]:
    """Engines outside the expected set that tried to handshake (newest last)."""
    return [
        {
            "identity": key,
            "dp_rank": seen.dp_rank,
            "handshakes": seen.handshakes,
            "last_seen_unix": seen.last_seen_unix,
        }
        for key, seen in unexpected.items()
    ]


def last_membership_json(snap: FleetSnapshot) -> dict[str, Any] | None:
    """The latest elastic-EP notification of any engine."""
    events = [e.detail.membership for e in snap.engines if e.detail.membership is not None]
    if not events:
        return None
    latest = max(events, key=lambda event: event.received_unix)
    return {"engine": latest.engine, **(membership_json(latest) or {})}


def last_action_json(last: LastAction | None) -> dict[str, Any] | None:
    if last is None:
        return None
    return {
        "action": last.action,
        "unix": last.unix,
        "status": last.status,
        "outcome": last.outcome,
        "success": last.outcome == "success",
        "duration_s": last.duration_s,
        "params": dict(last.params),
        "error": last.error,
        "engines": [
            {"engine": engine, "ok": ok, "reason": reason, "error": error}
            for engine, ok, reason, error in last.engines
        ],
        "failed_engines": [engine for engine, ok, _, _ in last.engines if not ok],
    }


def counters_json(stats: Stats) -> dict[str, Any]:
    # Every polled invariant is listed (0 when none failed): the document's shape does not
    # depend on what happened.
    failed: Counter[str] = Counter({inv.method: 0 for inv in READS})
    for (method, _engine, outcome), n in stats.utility_calls.items():
        if outcome != Outcome.OK.value and n:
            failed[method] += n
    actions: dict[str, dict[str, int]] = {}
    by_outcome: Counter[str] = Counter({o: 0 for o in OUTCOMES})
    for (action, outcome), n in sorted(stats.admin_actions.items()):
        if n:
            actions.setdefault(action, {})[outcome] = n
            by_outcome[outcome] += n
    return {
        "since_unix": stats.started_unix,
        "polls": stats.polls,
        "inconsistencies": {m: n for m, n in sorted(stats.inconsistent_results.items())},
        "failed_calls": dict(sorted(failed.items())),
        "failed_calls_total": sum(failed.values()),
        "actions": actions,
        "actions_by_outcome": dict(by_outcome),
    }


def history_json(history: FleetHistory | None, now: float) -> dict[str, Any]:
    if history is None:
        return {"bucket_s": 0, "window_s": 0, "entries": []}
    return {
        "bucket_s": history.bucket_s,
        "window_s": history.window_s,
        "entries": [
            {
                "start_unix": e.start_unix,
                "end_unix": e.end_unix,
                "polls": e.polls,
                "states": dict(e.states),
                "engines_up_min": e.engines_up_min,
                "engines_expected": e.engines_expected,
            }
            for e in history.entries(now)
        ],
    }


def status_steps(
    snap: FleetSnapshot,
    config: ServeConfig,
    stats: Stats | None = None,
    history: FleetHistory | None = None,
    now: float | None = None,
    unexpected: Mapping[str, UnexpectedEngine] | None = None,
    feeds: Mapping[str, Any] | None = None,
    source: Mapping[str, Any] | None = None,
) -> Steps[dict[str, Any]]:
    """The ``/status`` document, in steps of ``ENGINES_PER_STEP`` engines (``exporter.base.steps``):
    the plugin builds it on vLLM's event loop."""
    now = time.time() if now is None else now
    engines = []
    for position, e in enumerate(snap.engines, 1):
        if every(position):
            yield
        engines.append(engine_json(e, now, stats))
    unsupported: dict[str, list[str]] = {inv.method: [] for inv in INVARIANTS}
    for e in snap.engines:
        for method in sorted(e.unsupported):
            unsupported.setdefault(method, []).append(e.engine)
    aggregate = {
        inv.method: verdict_json(
            snap.verdict(inv), inv.method in snap.verdicts, unsupported[inv.method], snap.expected
        )
        for inv in INVARIANTS
    }
    return {
        "schema_version": SCHEMA_VERSION,
        "version": __version__,
        "generated_unix": now,
        "attach": config.attach,
        "model_name": config.model_name,
        "ready": snap.ready,
        "engines_expected": snap.expected,
        "engines_connected": snap.connected,
        "last_poll": {
            "number": snap.poll_number,
            "unix": snap.taken_at_unix or None,
            "duration_s": snap.poll_duration_s if snap.poll_number else None,
            "source": dict(source if source is not None else ALONE),
        },
        "aggregate": aggregate,
        "fault_tolerance": fleet_fault_tolerance_json(snap),
        "elastic_ep_operations": elastic_ep_json(snap.elastic_ep),
        "last_membership_event": last_membership_json(snap),
        "unexpected_engines": unexpected_json(unexpected or {}),
        "feeds": dict(feeds) if feeds is not None else {"watch": None, "load_publisher": None},
        "engines": engines,
        "last_action": last_action_json(stats.last_action if stats else None),
        "counters": counters_json(stats if stats is not None else Stats()),
        "history": history_json(history, now),
    }


def json_steps(doc: Mapping[str, Any], key: str = "engines") -> Steps[bytes]:
    """``json.dumps(doc)`` as bytes, the list under ``key`` written ``ENGINES_PER_STEP`` items
    per step: the same text (``json.dumps``'s separators, keys in the document's order)."""
    parts = []
    for name, value in doc.items():
        if name != key:
            parts.append(f"{json.dumps(name)}: {json.dumps(value)}")
            continue
        items = []
        for position, item in enumerate(value, 1):
            if every(position):
                yield
            items.append(json.dumps(item))
        parts.append(f"{json.dumps(name)}: [{', '.join(items)}]")
    return ("{" + ", ".join(parts) + "}").encode()
