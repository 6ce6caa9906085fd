"""``vllm-dp-exporter ctl``: the admin reset and the fleet status from shell scripts.

Exit codes: 0 success, 2 partial failure (some engine did not confirm, or the fleet is not
consistent), 1 any other error (unreachable exporter, bad token, bad request).

Strings in the answers come from engines and peers (a vLLM version, an error text): every one
is printed with its control characters escaped (``clean``), so none can move the cursor,
recolour or clear the terminal, or start a fake table row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import aiohttp

from exporter.config_rules import read_token_file
from exporter.error import ConfigError

EXIT_OK, EXIT_ERROR, EXIT_PARTIAL = 0, 1, 2


def add_ctl_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ctl_command", required=True)
    reset = sub.add_parser("reset-prefix-cache", help="reset the prefix cache on every engine")
    reset.add_argument("--admin-url", default="http://127.0.0.1:19401")
    reset.add_argument("--token-file", default=None)
    reset.add_argument("--reset-running-requests", action="store_true")
    reset.add_argument("--reset-connector", action="store_true")
    reset.add_argument("--idempotency-key", default=None)
    reset.add_argument("--json", action="store_true", help="print the JSON answer")
    reset.add_argument("--timeout", type=float, default=60.0)
    status = sub.add_parser("status", help="print the per-engine state")
    status.add_argument("--url", default="http://127.0.0.1:19400")
    status.add_argument("--json", action="store_true", help="print the JSON answer")
    status.add_argument("--timeout", type=float, default=10.0)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def clean(value: Any) -> str:
    """``str(value)`` with every unprintable character (C0/C1 controls such as ESC, CR, LF and
    TAB; DEL; format characters such as bidi overrides; line and paragraph separators)
    written as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def _text(value: Any) -> str:
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else clean(value)


def format_reset(body: dict[str, Any]) -> str:
    rows = [
        [
            _text(e.get("engine")),
            "yes" if e.get("ok") else "no",
            _text(e.get("reason")),
            _text(e.get("error")),
        ]
        for e in body.get("engines", [])
    ]
    head = f"prefix-cache reset: {clean(body.get('outcome', 'failure'))}"
    if body.get("error"):
        head += f" ({clean(body['error'])})"
    return head + "\n" + table(["ENGINE", "OK", "REASON", "ERROR"], rows)


def format_status(body: dict[str, Any]) -> str:
    agg = body.get("aggregate", {}).get("is_sleeping", {})
    state = agg.get("state", "unknown")
    paused = body.get("is_scheduler_paused", {}).get("value") is True
    asleep = "paused" if paused else "asleep"  # is_sleeping is also true while only paused
    verdict = state if state != "consistent" else (asleep if agg.get("value") else "awake")
    head = clean(
        f"fleet: {verdict}  engines connected {body.get('engines_connected')}/"
        f"{body.get('engines_expected')}  last poll #{body.get('last_poll', {}).get('number')}"
    )
    weights = body.get("aggregate", {}).get("get_weight_version", {})
    if weights.get("state") == "consistent":
        head += f"  weights {clean(_text(weights.get('value')))}"
    elif weights.get("state") == "inconsistent":
        head += "  weights INCONSISTENT"
    for verdict_body in (agg, weights):
        if verdict_body.get("error"):
            head += f"\n{clean(verdict_body['error'])}"
    rows = [
        [
            _text(e.get("engine")),
            _text(e.get("state")),
            "up" if e.get("up") else "down",
            _text(e.get("outcome")),
            _text(e.get("weight_version")),
            _text(e.get("vllm_version")),
            _text(e.get("error")),
        ]
        for e in body.get("engines", [])
    ]
    headers = ["ENGINE", "STATE", "UP", "OUTCOME", "WEIGHTS", "VLLM", "ERROR"]
    return head + "\n" + table(headers, rows)


async def _reset(args: argparse.Namespace) -> int:
    headers = {}
    if args.token_file:
        try:
            token = read_token_file(args.token_file, "token file")
        except ConfigError as exc:
            print(f"ctl: cannot use {exc}", file=sys.stderr)
            return EXIT_ERROR
        headers["Authorization"] = f"Bearer {token}"
    if args.idempotency_key:
        headers["Idempotency-Key"] = args.idempotency_key
    params = {
        "reset_running_requests": str(args.reset_running_requests).lower(),
        "reset_connector": str(args.reset_connector).lower(),
    }
    url = args.admin_url.rstrip("/") + "/admin/reset_prefix_cache"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as s:
        async with s.post(url, params=params, headers=headers) as resp:
            status = resp.status
            body = await resp.json(content_type=None)
    if not isinstance(body, dict):
        print(f"ctl: HTTP {status}: the answer is not a JSON object", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(body))
    elif "engines" in body:
        print(format_reset(body))
    if status == 200:
        return EXIT_OK
    if status == 502:
        return EXIT_PARTIAL
    print(f"ctl: HTTP {status}: {clean(body.get('error', body))}", file=sys.stderr)
    return EXIT_ERROR


async def _status(args: argparse.Namespace) -> int:
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


def run_ctl(args: argparse.Namespace) -> int:
    command = _reset if args.ctl_command == "reset-prefix-cache" else _status
    try:
        return asyncio.run(command(args))
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        print(f"ctl: {type(exc).__name__}: {clean(exc)}", file=sys.stderr)
        return EXIT_ERROR
