"""Who sent a request to the plugin's admin routes: the connection's peer, never a header.

vLLM's launcher builds uvicorn with its defaults: ``proxy_headers`` on and ``X-Forwarded-For``
trusted from loopback (``FORWARDED_ALLOW_IPS``: ``127.0.0.1,::1``). uvicorn's
``ProxyHeadersMiddleware`` wraps the whole app and rewrites ``scope["client"]`` in place to
whatever that header says, so any process on the host (or anything behind a local proxy)
would choose the key of the failed-token throttle and the ``client`` of the audit record.

So the admin routes read the peer from the connection: uvicorn hands the app the bound
``receive`` of its request cycle, which holds the transport. When a middleware wrapped
``receive`` (Starlette's ``BaseHTTPMiddleware``, a ``--middleware`` of vLLM's) the transport is
out of reach: ``scope["client"]`` is then believed only when no forwarding header came (only
then nothing rewrote it); otherwise the peer is unknown, and every such request shares one
throttle bucket (``source_key(None)``): fail closed, never keyed on a header's value. What a
forwarding header claimed is audited beside the peer, labelled ``forwarded_for``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.base.logs import log_audit

#: Headers a middleware may have rewritten the client address from.
FORWARDING_HEADERS = frozenset({b"x-forwarded-for", b"forwarded", b"x-real-ip"})
#: A forwarding header is the client's own text: at most this much of it reaches the audit.
MAX_FORWARDED_CHARS = 200
#: The audit's ``client`` when the connection's peer could not be read.
UNKNOWN = "unknown"

#: What forwarding headers claimed, for the audit record of the request being answered.
FORWARDED_FOR: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "dp_exporter_forwarded_for", default=None
)


@dataclass(frozen=True)
class Peer:
    #: The connection's peer address; None when it could not be read (unknown).
    address: str | None
    #: What forwarding headers claimed (printable, bounded); None without one.
    forwarded: str | None


def transport_peer(receive: Any) -> str | None:
    """The peer address of the connection behind uvicorn's ``receive`` (a bound method of its
    request cycle, which holds ``transport``); None when ``receive`` is anything else."""
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    get_extra_info = getattr(transport, "get_extra_info", None)
    if not callable(get_extra_info):
        return None
    try:
        peer = get_extra_info("peername")
    except Exception:  # a transport of another kind: unknown, never a crash
        return None
    if isinstance(peer, tuple | list) and peer and isinstance(peer[0], str) and peer[0]:
        return peer[0]
    return None


def forwarded_claim(raw_headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """Every forwarding header's value, joined, printable and bounded; None without one."""
    values = [v.decode("latin-1") for k, v in raw_headers if k.lower() in FORWARDING_HEADERS]
    if not values:
        return None
    text = "".join(c if c.isprintable() else "?" for c in ", ".join(values))
    return text if len(text) <= MAX_FORWARDED_CHARS else text[:MAX_FORWARDED_CHARS] + "..."


def request_peer(
    receive: Any, scope_client: tuple[str, int] | None, raw_headers: Iterable[tuple[bytes, bytes]]
) -> Peer:
    """The request's peer: the transport's; else ``scope["client"]`` when no forwarding header
    could have rewritten it; else unknown."""
    forwarded = forwarded_claim(raw_headers)
    address = transport_peer(receive)
    if address is None and forwarded is None and scope_client is not None:
        address = scope_client[0] or None
    return Peer(address, forwarded)


def audit_with_peer(record: Mapping[str, Any]) -> None:
    """The plugin's audit sink: ``log_audit`` with ``client`` the connection's peer (or
    ``unknown``) and, right after it, ``forwarded_for`` when a forwarding header came."""
    forwarded = FORWARDED_FOR.get()
    shown: dict[str, Any] = {}
    for key, value in record.items():
        shown[key] = UNKNOWN if key == "client" and value is None else value
        if key == "client" and forwarded is not None:
            shown["forwarded_for"] = forwarded
    log_audit(shown)
