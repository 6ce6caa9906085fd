"""What every ``ctl`` subcommand shares: exit codes, sanitised tables, the admin request."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from exporter.config.rules import read_token_file
from exporter.error import ConfigError

EXIT_OK, EXIT_ERROR, EXIT_PARTIAL = 0, 1, 2
DEFAULT_ADMIN_URL = "http://127.0.0.1:19401"
DEFAULT_URL = "http://127.0.0.1:19400"
#: Longest stretch of a non-JSON answer quoted in an error line.
MAX_QUOTED = 200


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


def text(value: Any) -> str:
    """A table cell: ``-`` for None, ``true``/``false`` for booleans, anything else cleaned."""
    if value is None:
        return "-"
    return str(value).lower() if isinstance(value, bool) else clean(value)


def add_admin_options(p: argparse.ArgumentParser, timeout: float) -> None:
    """The options of every admin subcommand (``reset-prefix-cache``, ``sleep``, ...)."""
    p.add_argument("--admin-url", default=DEFAULT_ADMIN_URL)
    p.add_argument("--token-file", default=None, help="file holding the admin bearer token")
    p.add_argument("--idempotency-key", default=None, help="retry safely: same key, same answer")
    p.add_argument("--json", action="store_true", help="print the JSON answer")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds (default %(default)s)")


def admin_headers(args: argparse.Namespace) -> dict[str, str]:
    """Authorization and Idempotency-Key headers (raises ConfigError for a bad token file)."""
    headers = {}
    if args.token_file:
        token = read_token_file(args.token_file, "token file")
        headers["Authorization"] = f"Bearer {token}"
    if args.idempotency_key:
        headers["Idempotency-Key"] = args.idempotency_key
    return headers


def parse_answer(status: int, raw: bytes) -> dict[str, Any] | str:
    """The JSON object of an answer, or an error line when it is not one."""
    try:
        body = json.loads(raw)
    except ValueError:
        quoted = clean(raw[:MAX_QUOTED].decode("utf-8", "replace").strip())
        return f"HTTP {status}: the answer is not JSON: {quoted}"
    if not isinstance(body, dict):
        return f"HTTP {status}: the answer is not a JSON object"
    return body


async def post_admin(
    args: argparse.Namespace,
    action: str,
    formatter: Callable[[dict[str, Any]], str],
    params: Mapping[str, str] | None = None,
    payload: Any = None,
) -> int:
    """``POST /admin/<action>``, print the answer, and its exit code: 0 on 200, 2 on 502
    (partial failure: nothing is rolled back), 1 on anything else."""
    try:
        headers = admin_headers(args)
    except ConfigError as exc:
        print(f"ctl: cannot use {exc}", file=sys.stderr)
        return EXIT_ERROR
    url = args.admin_url.rstrip("/") + "/admin/" + action
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout)) as s:
        async with s.post(url, params=dict(params or {}), headers=headers, json=payload) as resp:
            status = resp.status
            raw = await resp.read()
    body = parse_answer(status, raw)
    if isinstance(body, str):
        print(f"ctl: {body}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(body))
    elif "engines" in body:
        print(formatter(body))
    if status == 200:
        return EXIT_OK
    if status == 502:
        return EXIT_PARTIAL
    print(f"ctl: HTTP {status}: {clean(body.get('error', body))}", file=sys.stderr)
    return EXIT_ERROR
