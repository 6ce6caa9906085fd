"""``ctl checkpoint prepare [--mode M]`` and ``ctl checkpoint restore``: vLLM 0.34's process
checkpoint on every rank (``POST /admin/checkpoint_prepare``, ``/admin/checkpoint_restore``,
through ``exporter.remote``), each rank's state read back, so a snapshot script knows which
rank is where without reading vLLM's own aggregate (which does not say which rank is behind).

As every admin subcommand (``admin``): one row per engine, STATE being its checkpoint state
read back (``prepared``; ``failed (its error)``); exit 0 when every rank confirmed, 2 on a
partial failure (a rank refused, failed or was not read back as it should be; nothing is rolled
back), 4 when no engine has the lifecycle (vLLM before 0.34, or none with sleep mode: nothing
was changed), 1 on anything else. A prepare answers once every rank started: ``ctl wait
--checkpoint prepared`` holds once every rank can be captured.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable
from typing import Any

from exporter.commands.ctl.admin import ACTION_TIMEOUT, format_action
from exporter.commands.ctl.common import add_admin_options, post_admin, text
from exporter.protocol.utility import PAUSE_MODES
from exporter.remote import ActionResult, Client


def add_checkpoint_command(sub: Any) -> None:
    p = sub.add_parser("checkpoint", help="vLLM 0.34's process checkpoint on every rank")
    steps = p.add_subparsers(dest="checkpoint_command", metavar="{prepare,restore}", required=True)
    prepare = steps.add_parser(
        "prepare", help="every rank drains and releases what a snapshot must not hold (verified)"
    )
    prepare.add_argument(
        "--mode",
        choices=PAUSE_MODES,
        default=None,
        help="what happens to running requests first (default: vLLM's wait)",
    )
    add_admin_options(prepare, ACTION_TIMEOUT)
    restore = steps.add_parser("restore", help="every rank serves again (verified)")
    add_admin_options(restore, ACTION_TIMEOUT)


def checkpoint_cell(state: Any) -> str:
    """A rank's ``[state, error]`` read back as one cell: ``failed (CUDA error)``."""
    if isinstance(state, list) and len(state) == 2 and isinstance(state[0], str):
        return text(state[0]) + (f" ({text(state[1])})" if state[1] is not None else "")
    return text(state)


def format_checkpoint(body: dict[str, Any]) -> str:
    """``format_action``'s table with each rank's checkpoint state as one readable cell."""
    engines = [
        {**e, "state": checkpoint_cell(e.get("state"))} if isinstance(e, dict) else e
        for e in body.get("engines", [])
    ]
    return format_action({**body, "engines": engines})


async def run_checkpoint(args: argparse.Namespace) -> int:
    def call(client: Client) -> Awaitable[ActionResult]:
        if args.checkpoint_command == "prepare":
            return client.checkpoint_prepare(
                args.mode, idempotency_key=args.idempotency_key, timeout_s=args.timeout
            )
        return client.checkpoint_restore(
            idempotency_key=args.idempotency_key, timeout_s=args.timeout
        )

    return await post_admin(args, format_checkpoint, call)
