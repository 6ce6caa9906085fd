"""``ctl wait``: poll ``GET /gate`` until every engine meets the conditions, or time out.

The one line an RL script runs before it resumes traffic:
``ctl wait --weight-version V --awake --resumed --timeout 300``; before a weight update,
``ctl wait --drained --timeout 60`` holds once every rank has finished its work; around a process
snapshot (vLLM 0.34), ``ctl wait --checkpoint prepared`` once every rank can be captured and
``--checkpoint running`` once every one serves again. Exit 0 once
the gate answers 200; exit 1 when the timeout passes (printing, per failing engine, what still
fails) or when the gate rejects the question itself (400: a bad condition; 404: no gate on that
address); exit 4 for a condition no engine can answer (501). While it waits, each change in
what still fails goes to stderr (``ctl: waiting (2.0s): engine 1: drained: has work
(running 2, waiting 0), expected drained=true``). Connection errors, 412 and 5xx answers are
retried until the timeout: an exporter that is restarting, or engines that are still waking,
do not fail the script at once. The loop is ``exporter.remote.Client.wait``'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from exporter.commands.ctl.common import (
    DEFAULT_URL,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNSUPPORTED,
    add_connection_options,
    clean,
    connect,
    text,
)
from exporter.protocol.checkpoint import GATE_STATES
from exporter.remote import BadRequest, Progress, RemoteError, Unsupported, WaitTimeout
from exporter.remote.waiting import REQUEST_TIMEOUT_S


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
    p.add_argument(
        "--healthy",
        action="store_true",
        help="no rank reports a fault-tolerance status other than healthy",
    )
    work = p.add_mutually_exclusive_group()
    work.add_argument(
        "--drained",
        dest="drained",
        action="store_true",
        default=None,
        help="every rank finished its work (has_work false, no request running or waiting)",
    )
    work.add_argument("--busy", dest="drained", action="store_false", help="every rank has work")
    p.add_argument(
        "--checkpoint",
        choices=GATE_STATES,
        default=None,
        help="every rank's vLLM 0.34 checkpoint state is this (prepared: safe to capture)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds (default %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between checks")
    p.add_argument("--json", action="store_true", help="print the last gate answer as JSON")
    add_connection_options(p)


def gate_params(args: argparse.Namespace) -> dict[str, str]:
    params = {}
    if args.weight_version is not None:
        params["weight_version"] = args.weight_version
    if args.sleeping is not None:
        params["sleeping"] = str(args.sleeping).lower()
    if args.paused is not None:
        params["paused"] = str(args.paused).lower()
    if args.healthy:
        params["healthy"] = "true"
    if args.drained is not None:
        params["drained"] = str(args.drained).lower()
    if args.checkpoint is not None:
        params["checkpoint"] = args.checkpoint
    return params


def describe_conditions(conditions: dict[str, Any]) -> str:
    return " ".join(f"{clean(k)}={text(v)}" for k, v in conditions.items()) or "(none)"


def format_failing(body: dict[str, Any]) -> str:
    """What still fails, one line per failing engine (every string sanitised); the gate's
    ``drained`` failure carries the rank's running and waiting counts where they are known."""
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


def progress_lines(progress: Progress) -> list[str]:
    """What one check that did not open the gate says: what still fails (a line per failing
    engine), or why the gate could not be asked."""
    if progress.result is not None:
        failing = format_failing(dict(progress.result.raw))
        if failing:
            return failing.splitlines()
    return [progress.summary]


class Reporter:
    """``wait``'s progress on stderr: what still fails, each time it changes (a rank that
    drains shows its new counts; an unchanged answer prints nothing)."""

    def __init__(self) -> None:
        self.last: list[str] = []

    def __call__(self, progress: Progress) -> None:
        lines = progress_lines(progress)
        if lines == self.last:
            return
        self.last = lines
        for line in lines:
            print(f"ctl: waiting ({progress.elapsed_s:.1f}s): {line}", file=sys.stderr)


#: Conditions an older exporter's gate does not know (it answers 400 naming them).
NEWER_CONDITIONS = ("drained", "checkpoint")


def rejected(exc: RemoteError, params: dict[str, str]) -> str:
    """Why the gate rejected the question (an exporter older than ``drained`` or
    ``checkpoint`` says so)."""
    line = f"HTTP {exc.status} from {exc.url}: {exc.detail}"
    for name in NEWER_CONDITIONS:
        if isinstance(exc, BadRequest) and name in params and f"'{name}'" in exc.detail:
            line += f" (this exporter predates the {name} condition: upgrade it)"
    return line


async def run_wait(args: argparse.Namespace) -> int:
    if args.interval <= 0 or args.timeout < 0:
        print("ctl: --interval must be positive and --timeout not negative", file=sys.stderr)
        return EXIT_ERROR
    params = gate_params(args)
    client = connect(args, url=args.url, admin_url=None)  # ConfigError: run_ctl says why, exit 1
    async with client:
        try:
            opened = await client.wait(
                params,
                args.timeout,
                progress=Reporter(),
                interval_s=args.interval,
                request_timeout_s=REQUEST_TIMEOUT_S,
            )
        except WaitTimeout as exc:
            last = dict(exc.last.raw) if exc.last is not None else None
            if args.json and last is not None:
                print(json.dumps(last))
            elif last is not None:
                print(format_failing(last))
            print(
                f"ctl: wait timed out after {args.timeout:g}s for {describe_conditions(params)}"
                f" (last: {exc.last_error})",
                file=sys.stderr,
            )
            return EXIT_ERROR
        except Unsupported as exc:  # no engine can answer a condition: waiting cannot help
            print(f"ctl: {describe_conditions(params)}: {exc}", file=sys.stderr)
            return EXIT_UNSUPPORTED
        except RemoteError as exc:  # the question itself is wrong (a 4xx but 412)
            print(f"ctl: {rejected(exc, params)}", file=sys.stderr)
            return EXIT_ERROR
    body = dict(opened.raw)
    conditions = describe_conditions(body.get("conditions", {}))
    engines = len(body.get("engines", []))
    message = f"gate open: {engines} engines meet {conditions}"
    print(json.dumps(body) if args.json else message)
    return EXIT_OK
