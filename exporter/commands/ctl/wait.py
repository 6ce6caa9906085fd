"""``ctl wait``: poll ``GET /gate`` until every engine meets the conditions, or time out.

The one line an RL script runs before it resumes traffic:
``ctl wait --weight-version V --awake --resumed --timeout 300``. Exit 0 once the gate answers
200; exit 1 when the timeout passes (printing, per failing engine, what still fails) or when
the gate rejects the question itself (400: a bad condition; 404: no gate on that address).
Connection errors, 412 and 5xx answers are retried until the timeout: an exporter that is
restarting, or engines that are still waking, do not fail the script at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import aiohttp

from exporter.commands.ctl.common import DEFAULT_URL, EXIT_ERROR, EXIT_OK, clean, parse_answer, text

#: Longest single gate request (the gate itself bounds its fan-out by --call-timeout).
REQUEST_TIMEOUT_S = 30.0


def add_wait_command(sub: Any) -> None:
    p = sub.add_parser("wait", help="wait until every engine meets the conditions (GET /gate)")
    p.add_argument("--url", default=DEFAULT_URL, help="the exporter's metrics listener")
    p.add_argument("--weight-version", default=None, metavar="V", help="every engine reports V")
    sleep = p.add_mutually_exclusive_group()
    sleep.add_argument(
        "--awake", dest="sleeping", action="store_false", default=None, help="no engine sleeps"
    )
    sleep.add_argument("--asleep", dest="sleeping", action="store_true", help="every one sleeps")
    pause = p.add_mutually_exclusive_group()
    pause.add_argument(
        "--resumed", dest="paused", action="store_false", default=None, help="no scheduler paused"
    )
    pause.add_argument("--paused", dest="paused", action="store_true", help="every one paused")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--json", action="store_true", help="print the last gate answer as JSON")


def gate_params(args: argparse.Namespace) -> dict[str, str]:
    params = {}
    if args.weight_version is not None:
        params["weight_version"] = args.weight_version
    if args.sleeping is not None:
        params["sleeping"] = str(args.sleeping).lower()
    if args.paused is not None:
        params["paused"] = str(args.paused).lower()
    return params


def describe_conditions(conditions: dict[str, Any]) -> str:
    return " ".join(f"{clean(k)}={text(v)}" for k, v in conditions.items()) or "(none)"


def format_failing(body: dict[str, Any]) -> str:
    """What still fails, one line per failing engine (every string sanitised)."""
    lines = []
    if body.get("error"):
        lines.append(clean(body["error"]))
    for engine in body.get("engines", []):
        if engine.get("ok"):
            continue
        failures = "; ".join(clean(f) for f in engine.get("failures", [])) or "failing"
        lines.append(f"engine {text(engine.get('engine'))}: {failures}")
    if not lines and body.get("failing_engines"):
        names = ", ".join(text(e) for e in body["failing_engines"])
        lines.append(f"failing engines: {names}")
    return "\n".join(lines)


async def _check(
    session: aiohttp.ClientSession, url: str, params: dict[str, str], timeout_s: float
) -> tuple[int, dict[str, Any] | str]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, params=params, timeout=timeout) as resp:
        return resp.status, parse_answer(resp.status, await resp.read())


async def run_wait(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.timeout < 0:
        print("ctl: --interval must be positive and --timeout not negative", file=sys.stderr)
        return EXIT_ERROR
    url = args.url.rstrip("/") + "/gate"
    params = gate_params(args)
    deadline = time.monotonic() + args.timeout
    last: dict[str, Any] | None = None
    last_error = "no answer yet"
    async with aiohttp.ClientSession() as session:
        while True:
            remaining = deadline - time.monotonic()
            try:
                status, body = await _check(
                    session, url, params, max(0.5, min(REQUEST_TIMEOUT_S, remaining))
                )
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                last_error = f"{type(exc).__name__}: {clean(exc)}"
            else:
                if isinstance(body, str):
                    status_error: str | None = body
                else:
                    last, status_error = body, None
                if status == 200 and status_error is None:
                    assert last is not None
                    conditions = describe_conditions(last.get("conditions", {}))
                    engines = len(last.get("engines", []))
                    opened = f"gate open: {engines} engines meet {conditions}"
                    print(json.dumps(last) if args.json else opened)
                    return EXIT_OK
                if 400 <= status < 500 and status != 412:  # the question itself is wrong
                    error = status_error or clean(last.get("error", last) if last else "")
                    print(f"ctl: HTTP {status} from {url}: {error}", file=sys.stderr)
                    return EXIT_ERROR
                last_error = status_error or f"HTTP {status}"
            if deadline - time.monotonic() <= 0:
                break
            await asyncio.sleep(min(args.interval, max(0.0, deadline - time.monotonic())))
    if args.json and last is not None:
        print(json.dumps(last))
    elif last is not None:
        print(format_failing(last))
    print(
        f"ctl: wait timed out after {args.timeout:g}s for {describe_conditions(params)}"
        f" (last: {last_error})",
        file=sys.stderr,
    )
    return EXIT_ERROR
