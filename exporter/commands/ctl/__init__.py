"""``vllm-dp-exporter ctl``: the admin actions, the fleet status, the safe-to-resume wait and
the per-rank feed (``watch``) from shell scripts and RL training loops.

Exit codes: 0 success (``watch``: stopped by ``--count``, Ctrl-C or SIGTERM), 2 partial failure
(some engine did not confirm an action, or the fleet is not consistent), 4 unsupported (no
engine can do the action, or answer ``wait``'s condition), 1 any other error (unreachable
exporter, bad token, bad request, ``wait`` timed out, ``watch`` gave up).

Every HTTP call goes through ``exporter.remote`` (TLS and basic auth included: ``--ca-file``,
``--cert-file``, ``--key-file``, ``--basic-auth-file`` or ``$VLLM_DP_EXPORTER_CTL_BASIC_AUTH``).

Strings in the answers come from engines and peers (a vLLM version, an error text): every one
is printed with its control characters escaped (``clean``), so none can move the cursor,
recolour or clear the terminal, or start a fake table row.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from exporter.commands.ctl.admin import (
    Runner,
    add_admin_commands,
    format_action,
    format_reset,
    runner,
)
from exporter.commands.ctl.checkpoint import add_checkpoint_command, run_checkpoint
from exporter.commands.ctl.common import EXIT_ERROR, clean
from exporter.commands.ctl.status import add_status_command, format_status, run_status
from exporter.commands.ctl.wait import add_wait_command, run_wait
from exporter.commands.ctl.watch import add_watch_command, run_watch
from exporter.error import ConfigError
from exporter.remote import RemoteError

__all__ = [
    "add_ctl_arguments",
    "clean",
    "format_action",
    "format_reset",
    "format_status",
    "run_ctl",
]


def add_ctl_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ctl_command", required=True)
    add_status_command(sub)
    add_wait_command(sub)
    add_watch_command(sub)
    add_admin_commands(sub)
    add_checkpoint_command(sub)


def run_ctl(args: argparse.Namespace) -> int:
    commands: dict[str, Runner] = {
        "status": run_status,
        "wait": run_wait,
        "watch": run_watch,
        "checkpoint": run_checkpoint,
    }
    command = commands.get(args.ctl_command) or runner(args.ctl_command)
    if command is None:
        print(f"ctl: unknown command {clean(args.ctl_command)}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return asyncio.run(command(args))
    except RemoteError as exc:
        print(f"ctl: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ConfigError as exc:
        print(f"ctl: cannot use {exc}", file=sys.stderr)
        return EXIT_ERROR
    except ValueError as exc:
        print(f"ctl: {type(exc).__name__}: {clean(exc)}", file=sys.stderr)
        return EXIT_ERROR
