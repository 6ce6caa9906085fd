"""``ctl status``: the per-engine state from ``GET /status``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import aiohttp

from exporter.commands.ctl.common import (
    DEFAULT_URL,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PARTIAL,
    clean,
    table,
    text,
)


def add_status_command(sub: Any) -> None:
    status = sub.add_parser("status", help="print the per-engine state")
    status.add_argument("--url", default=DEFAULT_URL)
    status.add_argument("--json", action="store_true", help="print the JSON answer")
    status.add_argument("--timeout", type=float, default=10.0)


def _engine_row(e: dict[str, Any]) -> list[str]:
    """One engine: its ``is_sleeping`` answer and, while it is up, its weight version."""
    invariants = e.get("invariants", {})
    sleeping = invariants.get("is_sleeping", {})
    weights = invariants.get("get_weight_version", {}).get("value") if e.get("up") else None
    return [
        text(e.get("engine")),
        text(e.get("state")),
        "up" if e.get("up") else "down",
        text(sleeping.get("outcome")),
        text(weights),
        text(e.get("vllm_version")),
        text(sleeping.get("error")),
    ]


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
    for verdict_body in (agg, weights):
        if verdict_body.get("error"):
            head += f"\n{clean(verdict_body['error'])}"
    rows = [_engine_row(e) for e in body.get("engines", [])]
    headers = ["ENGINE", "STATE", "UP", "OUTCOME", "WEIGHTS", "VLLM", "ERROR"]
    return head + "\n" + table(headers, rows)


async def run_status(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/") + "/status"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as s:
        async with s.get(url) as resp:
            if resp.status != 200:
                print(f"ctl: HTTP {resp.status} from {url}", file=sys.stderr)
                return EXIT_ERROR
            body = await resp.json()
    if not isinstance(body, dict):
        print(f"ctl: {url}: the answer is not a JSON object", file=sys.stderr)
        return EXIT_ERROR
    print(json.dumps(body) if args.json else format_status(body))
    state = body.get("aggregate", {}).get("is_sleeping", {}).get("state")
    return EXIT_OK if state == "consistent" else EXIT_PARTIAL
