"""``ctl watch``: the per-rank feed (``GET /watch``) as one line per event, for a terminal or a
script (``exporter.remote.Client.watch``: it resumes by itself after a dropped connection).

A snapshot starts with a marker line (``snapshot (connect): 4 engines: 0, 1, 2, 3``), then one
line per rank and one per change, short and greppable::

    engine 0: awake (routable), running 2, waiting 0
    engine 1: hung (not routable: hung: no answer for 12 s; no answer in the last poll (timeout))

``--json`` prints each event as one JSON object (``{"event": ..., "id": ..., **data}``);
heartbeats only with ``--heartbeats``. ``--count N`` stops after N rank events. Each reconnect
says why on stderr. Exit 0 after ``--count`` events, Ctrl-C or SIGTERM; 1 when the feed cannot
be read (bad credentials, no ``/watch`` at that URL, the exporter unreachable through every
reconnect); every string from the feed is printed with its control characters escaped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from exporter.commands.ctl.common import (
    DEFAULT_URL,
    EXIT_ERROR,
    EXIT_OK,
    add_connection_options,
    clean,
    connect,
    text,
)
from exporter.remote import NotFound, Reconnect, Reconnecting, RemoteError, WatchEvent

#: The event kinds the text output knows (any other is printed by ``--json`` only).
SNAPSHOT, RANK, HEARTBEAT = "snapshot", "rank", "heartbeat"


def add_watch_command(sub: Any) -> None:
    p = sub.add_parser("watch", help="print each rank's row as it changes (GET /watch)")
    p.add_argument("--url", default=DEFAULT_URL, help="the exporter's metrics listener")
    p.add_argument("--json", action="store_true", help="one JSON object per event")
    p.add_argument("--count", type=int, default=None, metavar="N", help="stop after N rank events")
    p.add_argument("--heartbeats", action="store_true", help="print the heartbeats too")
    p.add_argument("--last-event-id", default=None, metavar="ID", help="resume after this id")
    p.add_argument(
        "--max-reconnects",
        type=int,
        default=Reconnect.max_failures,
        metavar="N",
        help="failed reconnects in a row before giving up (default %(default)s)",
    )
    add_connection_options(p)


def _activity(data: Mapping[str, Any]) -> str:
    """``, running 2, waiting 0`` where the attach mode counts requests (else ``, has_work
    true`` where it knows that much), and a fault-tolerance status other than healthy: what a
    change the state alone does not show may be."""
    shown = [f"{k} {text(data[k])}" for k in ("running", "waiting") if data.get(k) is not None]
    if not shown and isinstance(data.get("has_work"), bool):
        shown.append(f"has_work {text(data['has_work'])}")
    fault = data.get("fault_tolerance")
    if fault is not None and fault != "healthy":
        shown.append(f"fault_tolerance {text(fault)}")
    return "".join(f", {part}" for part in shown)


def format_rank(data: Mapping[str, Any]) -> str:
    """``engine 1: hung (not routable: hung: no answer for 12 s)``, plus its activity."""
    reasons = data.get("reasons")
    why = "; ".join(clean(r) for r in reasons) if isinstance(reasons, list) else ""
    if data.get("routable") is True:
        verdict = "routable"
    else:
        verdict = f"not routable: {why}" if why else "not routable"
    state = text(data.get("state", "unknown"))
    return f"engine {text(data.get('engine'))}: {state} ({verdict}){_activity(data)}"


def format_snapshot(data: Mapping[str, Any]) -> str:
    """``snapshot (connect): 2 engines: 0, 1``: a fresh view starts, and why."""
    engines = data.get("engines")
    names = [text(e) for e in engines] if isinstance(engines, list) else []
    return f"snapshot ({text(data.get('reason'))}): {len(names)} engines: {', '.join(names)}"


def format_event(event: WatchEvent, *, as_json: bool, heartbeats: bool) -> str | None:
    """The line printed for ``event``, or None when it is not shown."""
    if event.kind == HEARTBEAT and not heartbeats:
        return None
    if as_json:
        return json.dumps(event.to_json())
    if event.kind == RANK:
        return format_rank(event.data)
    if event.kind == SNAPSHOT:
        return format_snapshot(event.data)
    if event.kind == HEARTBEAT:
        return f"heartbeat (poll {text(event.data.get('poll'))}, id {clean(event.id)})"
    return None


def report_reconnect(notice: Reconnecting) -> None:
    """Each reconnect, on stderr: why the connection ended and when the next attempt is."""
    tries = f", {notice.failures} failed in a row" if notice.failures else ""
    print(
        f"ctl: watch: {notice.error}; reconnecting in {notice.delay_s:.1f}s{tries}",
        file=sys.stderr,
        flush=True,
    )


@contextlib.contextmanager
def on_signals(callback: Callable[[], None]) -> Iterator[None]:
    """``callback`` on SIGINT and SIGTERM while inside (only the main thread can have them:
    elsewhere, as when a test runs the command in a thread, nothing is installed)."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, callback)
        except (RuntimeError, ValueError, NotImplementedError):
            continue
        installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def follow(args: argparse.Namespace) -> int:
    """Print the events until ``--count`` rank events were printed (or forever)."""
    client = connect(args, url=args.url, admin_url=None)  # ConfigError: run_ctl says why
    reconnect = Reconnect(max_failures=args.max_reconnects)
    ranks = 0
    async with client:
        watch = client.watch(args.last_event_id, reconnect=reconnect, on_reconnect=report_reconnect)
        async with watch:
            async for event in watch:
                line = format_event(event, as_json=args.json, heartbeats=args.heartbeats)
                if line is not None:
                    print(line, flush=True)
                if event.kind == RANK:
                    ranks += 1
                if args.count is not None and ranks >= args.count:
                    break
    return EXIT_OK


async def run_watch(args: argparse.Namespace) -> int:
    if (args.count is not None and args.count < 1) or args.max_reconnects < 0:
        print("ctl: --count must be positive and --max-reconnects not negative", file=sys.stderr)
        return EXIT_ERROR
    task = asyncio.current_task()
    assert task is not None
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        task.cancel()

    try:
        with on_signals(stop):
            return await follow(args)
    except asyncio.CancelledError:
        if not stopping.is_set():
            raise
        return EXIT_OK  # Ctrl-C or SIGTERM: a clean end
    except BrokenPipeError:  # ``ctl watch | head -3``: the reader left
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except NotFound as exc:
        print(f"ctl: {exc} (no /watch there: an exporter older than the feed?)", file=sys.stderr)
        return EXIT_ERROR
    except RemoteError as exc:
        print(f"ctl: {exc}", file=sys.stderr)
        return EXIT_ERROR
