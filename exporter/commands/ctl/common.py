"""What every ``ctl`` subcommand shares: exit codes, sanitised tables, the connection options
and the admin request, made through ``exporter.remote`` (the one HTTP path to an exporter)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from exporter.remote import (
    BASIC_AUTH_ENV,
    DEFAULT_ADMIN_URL,
    DEFAULT_URL,
    ActionResult,
    Client,
    Credentials,
    PartialFailure,
    RemoteError,
    Unsupported,
)
from exporter.remote import printable as clean

__all__ = [
    "DEFAULT_ADMIN_URL",
    "DEFAULT_URL",
    "EXIT_ERROR",
    "EXIT_OK",
    "EXIT_PARTIAL",
    "EXIT_UNSUPPORTED",
    "add_admin_options",
    "add_connection_options",
    "clean",
    "connect",
    "post_admin",
    "table",
    "text",
]

EXIT_OK, EXIT_ERROR, EXIT_PARTIAL = 0, 1, 2
#: No engine supports what was asked (HTTP 501): that vLLM cannot do it; nothing was changed.
#: 3 is left out: ``probe`` exits 3 for an inconsistent fleet.
EXIT_UNSUPPORTED = 4


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for r in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def text(value: Any) -> str:
    """A table cell: ``-`` for None, ``true``/``false`` for booleans, anything else cleaned."""
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else clean(value)


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """TLS and basic auth, for an exporter started with ``--web-config-file``. Credentials
    come from files or the environment, never from the command line (which every user of the
    host can read in the process table)."""
    p.add_argument("--ca-file", default=None, help="CA that signed the exporter's certificate")
    p.add_argument("--cert-file", default=None, help="client certificate (mutual TLS)")
    p.add_argument("--key-file", default=None, help="the client certificate's key")
    p.add_argument(
        "--basic-auth-file",
        default=None,
        metavar="FILE",
        help=f"file holding user:password (default: ${BASIC_AUTH_ENV} when set)",
    )


def add_admin_options(p: argparse.ArgumentParser, timeout: float) -> None:
    """The options of every admin subcommand (``reset-prefix-cache``, ``sleep``, ...)."""
    p.add_argument("--admin-url", default=DEFAULT_ADMIN_URL)
    p.add_argument("--token-file", default=None, help="file holding the admin bearer token")
    p.add_argument("--idempotency-key", default=None, help="retry safely: same key, same answer")
    p.add_argument("--json", action="store_true", help="print the JSON answer")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds (default %(default)s)")
    add_connection_options(p)


def connect(args: argparse.Namespace, *, url: str | None, admin_url: str | None) -> Client:
    """The client of one ctl run (raises ConfigError for a file that cannot be used)."""
    credentials = Credentials.load(
        token_file=getattr(args, "token_file", None),
        basic_auth_file=args.basic_auth_file,
        basic_auth_env=BASIC_AUTH_ENV,
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
    )
    return Client(url, admin_url, credentials=credentials)


def _print_answer(args: argparse.Namespace, body: Any, formatter: Callable[[Any], str]) -> None:
    if args.json:
        print(json.dumps(body))
    elif isinstance(body, dict) and "engines" in body:
        print(formatter(body))


async def post_admin(
    args: argparse.Namespace,
    formatter: Callable[[dict[str, Any]], str],
    call: Callable[[Client], Awaitable[ActionResult]],
) -> int:
    """Run one action (``call``) and print its answer; the exit code: 0 when every engine
    confirmed, 2 on a partial failure (nothing is rolled back), 4 when no engine supports the
    action, 1 on anything else."""
    # A ConfigError (a credentials file that cannot be used): run_ctl says why, exit 1.
    client = connect(args, url=None, admin_url=args.admin_url)
    async with client:
        try:
            result = await call(client)
        except PartialFailure as exc:
            _print_answer(args, exc.result.raw, formatter)
            return EXIT_PARTIAL
        except Unsupported as exc:
            if exc.result is not None:
                _print_answer(args, exc.result.raw, formatter)
            print(f"ctl: {exc}", file=sys.stderr)
            return EXIT_UNSUPPORTED
        except RemoteError as exc:
            if exc.body is not None:
                _print_answer(args, exc.body, formatter)
            print(f"ctl: {exc}", file=sys.stderr)
            return EXIT_ERROR
    _print_answer(args, result.raw, formatter)
    return EXIT_OK
