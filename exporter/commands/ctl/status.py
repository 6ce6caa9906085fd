"""``ctl status``: the per-engine state from ``GET /status`` (``exporter.remote.Client.status``):
one row per engine with its state, invariants, fault-tolerance status and activity (vLLM's
``has_work`` answer and its running and waiting requests; ``-`` while unknown: not read in
this attach mode, not this poll, or an exporter older than them). A CHECKPOINT column (vLLM
0.34's process-checkpoint state, ``failed (its error)``) only when some engine reports one, so
a fleet before 0.34 reads as before. ``--json`` prints the document as the exporter sent it."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exporter.commands.ctl.common import (
    DEFAULT_URL,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PARTIAL,
    add_connection_options,
    clean,
    connect,
    table,
    text,
)
from exporter.remote import InvalidAnswer, RemoteError, Unreachable


def add_status_command(sub: Any) -> None:
    status = sub.add_parser("status", help="print the per-engine state")
    status.add_argument("--url", default=DEFAULT_URL)
    status.add_argument("--json", action="store_true", help="print the JSON answer")
    status.add_argument("--timeout", type=float, default=10.0)
    add_connection_options(status)


HEADERS = [
    "ENGINE",
    "STATE",
    "UP",
    "OUTCOME",
    "WEIGHTS",
    "VLLM",
    "FAULT",
    "HAS_WORK",
    "RUNNING",
    "WAITING",
    "ERROR",
]


#: The optional column, placed before HAS_WORK when shown.
CHECKPOINT_HEADER = "CHECKPOINT"


def _checkpoint_row(e: dict[str, Any]) -> dict[str, Any]:
    row = e.get("invariants", {}).get("checkpoint_state")
    return row if isinstance(row, dict) else {}


def reports_checkpoint(engines: list[dict[str, Any]]) -> bool:
    """Whether any engine was asked its checkpoint state and has the method (vLLM 0.34)."""
    return any(_checkpoint_row(e).get("outcome") not in (None, "unsupported") for e in engines)


def checkpoint_cell(e: dict[str, Any]) -> str:
    """``prepared``, ``failed (CUDA error)``; ``-`` while unknown (a failed read too)."""
    value = _checkpoint_row(e).get("value")
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        return "-"
    state, error = value
    return text(state) + (f" ({text(error)})" if error is not None else "")


def _engine_row(e: dict[str, Any]) -> list[str]:
    """One engine: its ``is_sleeping`` answer, its weight version while it is up, and what
    it is doing (``has_work``, running and waiting requests; ``-`` while unknown)."""
    invariants = e.get("invariants", {})
    sleeping = invariants.get("is_sleeping", {})
    weights = invariants.get("get_weight_version", {}).get("value") if e.get("up") else None
    activity = e.get("activity")
    if not isinstance(activity, dict):  # an exporter older than the field
        activity = {}
    return [
        text(e.get("engine")),
        text(e.get("state")),
        "up" if e.get("up") else "down",
        text(sleeping.get("outcome")),
        text(weights),
        text(e.get("vllm_version")),
        _fault(e.get("fault_tolerance")),
        text(activity.get("has_work")),
        text(activity.get("running")),
        text(activity.get("waiting")),
        text(sleeping.get("error")),
    ]


def _fault(ft: Any) -> str:
    """The engine's fault-tolerance status (``-`` while it never reported one)."""
    if not isinstance(ft, dict):
        return "-"
    info = ft.get("fault_info")
    return text(ft.get("status")) + (f" ({text(info)})" if info else "")


def format_status(body: dict[str, Any]) -> str:
    aggregate = body.get("aggregate", {})
    agg = aggregate.get("is_sleeping", {})
    state = agg.get("state", "unknown")
    paused = aggregate.get("is_scheduler_paused", {}).get("value") is True
    asleep = "paused" if paused else "asleep"  # is_sleeping is also true while only paused
    verdict = state if state != "consistent" else (asleep if agg.get("value") else "awake")
    head = clean(
        f"fleet: {verdict}  engines connected {body.get('engines_connected')}/"
        f"{body.get('engines_expected')}  last poll #{body.get('last_poll', {}).get('number')}"
    )
    weights = aggregate.get("get_weight_version", {})
    if weights.get("state") == "consistent":
        head += f"  weights {clean(text(weights.get('value')))}"
    elif weights.get("state") == "inconsistent":
        head += "  weights INCONSISTENT"
    fault_tolerance = body.get("fault_tolerance", {})
    faulty = fault_tolerance.get("faulty_engines") or []
    if faulty:
        head += "  FAULTY " + ",".join(text(e) for e in faulty)
    elif fault_tolerance.get("healthy", True) is None:
        head += "  fault tolerance: not available in this mode"
    engines = body.get("engines", [])
    checkpoint = reports_checkpoint(engines)
    if checkpoint:
        head += _checkpoint_verdict(aggregate.get("checkpoint_state", {}))
    for verdict_body in (agg, weights):
        if verdict_body.get("error"):
            head += f"\n{clean(verdict_body['error'])}"
    headers, rows = HEADERS, [_engine_row(e) for e in engines]
    if checkpoint:
        at = HEADERS.index("HAS_WORK")
        headers = [*HEADERS[:at], CHECKPOINT_HEADER, *HEADERS[at:]]
        rows = [[*r[:at], checkpoint_cell(e), *r[at:]] for r, e in zip(rows, engines, strict=True)]
    return head + "\n" + table(headers, rows)


def _checkpoint_verdict(verdict: dict[str, Any]) -> str:
    """The fleet line's part: ``checkpoint prepared`` when every rank agrees,
    ``checkpoint INCONSISTENT`` when they do not (the rows say which)."""
    value = verdict.get("value")
    if verdict.get("state") == "consistent" and isinstance(value, list) and value:
        return f"  checkpoint {text(value[0])}"
    if verdict.get("state") == "inconsistent":
        return "  checkpoint INCONSISTENT"
    return ""


async def run_status(args: argparse.Namespace) -> int:
    client = connect(args, url=args.url, admin_url=None)  # ConfigError: run_ctl says why, exit 1
    async with client:
        try:
            status = await client.status(timeout_s=args.timeout)
        except Unreachable as exc:
            print(f"ctl: {exc}", file=sys.stderr)
            return EXIT_ERROR
        except RemoteError as exc:
            where = exc.url or args.url
            line = f"HTTP {exc.status} from {where}" if exc.status is not None else str(exc)
            if isinstance(exc, InvalidAnswer) and exc.status == 200:
                line = f"{where}: {exc.detail}"
            print(f"ctl: {line}", file=sys.stderr)
            return EXIT_ERROR
    body = dict(status.raw)
    print(json.dumps(body) if args.json else format_status(body))
    return EXIT_OK if status.consistent else EXIT_PARTIAL
