"""The admin subcommands: one per ``POST /admin/<action>`` of the admin listener, each a call
of ``exporter.remote.Client``.

Each prints one row per engine (``ENGINE OK REASON STATE ERROR``; STATE is what the exporter
read back after the call) and exits 0 when every engine confirmed, 2 on a partial failure
(HTTP 502: nothing is rolled back, the table says which engines are in which state), 4 when no
engine supports the action (HTTP 501: that vLLM cannot do it; nothing was changed), 1 on any
other error.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from exporter.commands.ctl.common import add_admin_options, clean, post_admin, table, text
from exporter.protocol.utility import PAUSE_MODES
from exporter.remote import ActionResult, Client
from exporter.remote.client import ACTION_TIMEOUT_S, RESET_TIMEOUT_S, VERIFY_TIMEOUT_S

#: Default --timeout of a state-changing action: the exporter's call and its read-back may take
#: --action-timeout (60 s) each.
ACTION_TIMEOUT = ACTION_TIMEOUT_S
#: verify-weights: the exporter waits up to --verify-weights-timeout (300 s) for checksums.
VERIFY_TIMEOUT = VERIFY_TIMEOUT_S
#: Mismatching parameters printed per engine (the answer lists at most the exporter's cap).
MAX_PARAMETERS_SHOWN = 10

Params = Callable[[argparse.Namespace], dict[str, str]]
Runner = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def _head(title: str, body: dict[str, Any]) -> str:
    head = f"{title}: {clean(body.get('outcome', 'failure'))}"
    if body.get("error"):
        head += f" ({clean(body['error'])})"
    return head


def format_reset(body: dict[str, Any]) -> str:
    rows = [
        [
            text(e.get("engine")),
            "yes" if e.get("ok") else "no",
            text(e.get("reason")),
            text(e.get("error")),
        ]
        for e in body.get("engines", [])
    ]
    return (
        _head("prefix-cache reset", body) + "\n" + table(["ENGINE", "OK", "REASON", "ERROR"], rows)
    )


def format_action(body: dict[str, Any]) -> str:
    """The answer of a collective action: one row per engine, and for ``verify_weights`` the
    mismatch count per engine, how many parameters were compared, those that could not be
    (checksums of empty input) and those that differ from the majority."""
    verify = body.get("action") == "verify_weights"
    rows, notes = [], []
    for e in body.get("engines", []):
        state = e.get("mismatches") if verify else e.get("state")
        rows.append(
            [
                text(e.get("engine")),
                "yes" if e.get("ok") else "no",
                text(e.get("reason")),
                text(state),
                text(e.get("error")),
            ]
        )
        if verify:
            notes.extend(_verify_notes(e))
    headers = ["ENGINE", "OK", "REASON", "MISMATCHES" if verify else "STATE", "ERROR"]
    out = _head(clean(body.get("action", "action")), body) + "\n" + table(headers, rows)
    return "\n".join([out, *notes])


def _names(listed: list[Any], total: int) -> str:
    """At most MAX_PARAMETERS_SHOWN names, and how many more ``total`` has."""
    shown = ", ".join(clean(p) for p in listed[:MAX_PARAMETERS_SHOWN])
    more = max(total, len(listed)) - min(len(listed), MAX_PARAMETERS_SHOWN)
    return shown + (f" (+{more} more)" if more > 0 else "")


def _verify_notes(e: dict[str, Any]) -> list[str]:
    """One engine's comparison under the table (each line starts with "engine <label>")."""
    engine = f"engine {text(e.get('engine'))}"
    notes = []
    compared, unverifiable = e.get("compared"), e.get("unverifiable")
    if isinstance(compared, int) and isinstance(unverifiable, int):  # an older exporter: none
        line = f"{engine}: compared {compared} of {text(e.get('parameters'))} parameters"
        if unverifiable:
            line += f"; {unverifiable} unverifiable (checksum of empty input)"
            listed = e.get("unverifiable_parameters") or []
            if listed:
                line += ": " + _names(listed, unverifiable)
        notes.append(line)
    listed = e.get("mismatching_parameters") or []
    if listed:
        notes.append(f"{engine} differs on: {_names(listed, len(listed))}")
    return notes


def _no_params(args: argparse.Namespace) -> dict[str, str]:
    return {}


@dataclass(frozen=True)
class AdminCommand:
    """``ctl <name>`` → ``POST /admin/<action>``."""

    name: str
    action: str
    help: str
    params: Params = _no_params
    timeout: float = ACTION_TIMEOUT


def _sleep_params(args: argparse.Namespace) -> dict[str, str]:
    params = {"level": str(args.level)}
    if args.mode is not None:  # (level,) only, unless asked: older vLLM takes no mode
        params["mode"] = args.mode
    return params


def _pause_params(args: argparse.Namespace) -> dict[str, str]:
    params = {"mode": args.mode} if args.mode is not None else {}
    if args.keep_cache:
        params["clear_cache"] = "false"
    return params


def _tags_params(args: argparse.Namespace) -> dict[str, str]:
    return {"tags": args.tags} if args.tags else {}


COMMANDS = {
    c.name: c
    for c in (
        AdminCommand("sleep", "sleep", "put every engine to sleep (verified)", _sleep_params),
        AdminCommand("wake-up", "wake_up", "wake every engine up (verified)", _tags_params),
        AdminCommand("pause", "pause", "pause every engine's scheduler (verified)", _pause_params),
        AdminCommand("resume", "resume", "resume every engine's scheduler (verified)"),
        AdminCommand(
            "set-weight-version", "weight_version", "set the weight version on every engine"
        ),
        AdminCommand("reset-mm-cache", "reset_mm_cache", "reset the multi-modal cache"),
        AdminCommand("reset-encoder-cache", "reset_encoder_cache", "reset the encoder cache"),
        AdminCommand(
            "verify-weights",
            "verify_weights",
            "compare weight checksums across DP ranks",
            timeout=VERIFY_TIMEOUT,
        ),
    )
}


def add_admin_commands(sub: Any) -> None:
    """``reset-prefix-cache`` and one subcommand per collective action."""
    reset = sub.add_parser("reset-prefix-cache", help="reset the prefix cache on every engine")
    reset.add_argument("--reset-running-requests", action="store_true")
    reset.add_argument("--reset-connector", action="store_true")
    add_admin_options(reset, RESET_TIMEOUT_S)
    for command in COMMANDS.values():
        p = sub.add_parser(command.name, help=command.help)
        if command.name == "sleep":
            p.add_argument("--level", type=int, choices=(0, 1, 2), default=1)
        if command.name in ("sleep", "pause"):
            p.add_argument(
                "--mode",
                choices=PAUSE_MODES,
                default=None,
                help="what happens to running requests (default: abort)",
            )
        if command.name == "pause":
            p.add_argument(
                "--keep-cache",
                action="store_true",
                help="vLLM keeps its caches (clear_cache=false; mode keep: the running "
                "requests' KV blocks too)",
            )
        if command.name == "wake-up":
            p.add_argument(
                "--tags",
                default=None,
                metavar="weights,kv_cache",
                help="wake only these (default: everything; verified then)",
            )
        if command.name == "set-weight-version":
            p.add_argument("weight_version", metavar="VERSION")
        add_admin_options(p, command.timeout)


async def run_reset(args: argparse.Namespace) -> int:
    def call(client: Client) -> Awaitable[ActionResult]:
        return client.reset_prefix_cache(
            reset_running_requests=args.reset_running_requests,
            reset_connector=args.reset_connector,
            idempotency_key=args.idempotency_key,
            timeout_s=args.timeout,
        )

    return await post_admin(args, format_reset, call)


async def run_action(args: argparse.Namespace) -> int:
    command = COMMANDS[args.ctl_command]
    body = None
    if command.action == "weight_version":
        body = {"weight_version": args.weight_version}

    def call(client: Client) -> Awaitable[ActionResult]:
        return client.action(
            command.action,
            command.params(args),
            body,
            idempotency_key=args.idempotency_key,
            timeout_s=args.timeout,
        )

    return await post_admin(args, format_action, call)


def runner(name: str) -> Runner | None:
    if name == "reset-prefix-cache":
        return run_reset
    return run_action if name in COMMANDS else None
