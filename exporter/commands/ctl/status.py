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


def format_status(body: dict[str, Any]) -> str:
    agg = body.get("aggregate", {}).get("is_sleeping", {})
    state = agg.get("state", "unknown")
    # schema_version 1 keeps every invariant in "aggregate"; older exporters put it beside.
    paused_verdict = body.get("aggregate", {}).get("is_scheduler_paused")
    paused = (paused_verdict or body.get("is_scheduler_paused", {})).get("value") is True
    asleep = "paused" if paused else "asleep"  # is_sleeping is also true while only paused
    verdict = state if state != "consistent" else (asleep if agg.get("value") else "awake")
    head = clean(
        f"fleet: {verdict}  engines connected {body.get('engines_connected')}/"
        f"{body.get('engines_expected')}  last poll #{body.get('last_poll', {}).get('number')}"
    )
    weights = body.get("aggregate", {}).get("get_weight_version", {})
    if weights.get("state") == "consistent":
        head += f"  weights {clean(text(weights.get('value')))}"
    elif weights.get("state") == "inconsistent":
        head += "  weights INCONSISTENT"
    for verdict_body in (agg, weights):
        if verdict_body.get("error"):
            head += f"\n{clean(verdict_body['error'])}"
    rows = [
        [
            text(e.get("engine")),
            text(e.get("state")),
            "up" if e.get("up") else "down",
            text(e.get("outcome")),
            text(e.get("weight_version")),
            text(e.get("vllm_version")),
            text(e.get("error")),
        ]
        for e in body.get("engines", [])
    ]
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
