"""Who sent an admin request to the plugin (``exporter.inprocess.peer``): the throttle key and
the audit's ``client`` must come from the connection, never from a header any local process
can set, and a peer that cannot be read is ``unknown`` (one shared bucket: fail closed)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from exporter.base.logs import FIELDS_ATTR
from exporter.inprocess import peer
from exporter.inprocess.peer import (
    FORWARDED_FOR,
    MAX_FORWARDED_CHARS,
    Peer,
    audit_with_peer,
    forwarded_claim,
    request_peer,
    transport_peer,
)


class Transport:
    def __init__(self, peername: Any = None, raises: bool = False) -> None:
        self.peername, self.raises = peername, raises

    def get_extra_info(self, name: str) -> Any:
        if self.raises:
            raise OSError("closed")
        return self.peername if name == "peername" else None


class Cycle:
    """uvicorn's request cycle as far as ``receive`` exposes it (a bound method)."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport

    async def receive(self) -> dict[str, Any]:
        return {}


def receive_of(peername: Any = None, raises: bool = False) -> Any:
    return Cycle(Transport(peername, raises)).receive


@pytest.mark.parametrize(
    ("receive", "address"),
    [
        (receive_of(("10.0.0.7", 5123)), "10.0.0.7"),
        (receive_of(("::1", 5123, 0, 0)), "::1"),
        (receive_of("/run/vllm.sock"), None),  # a unix socket: no address
        (receive_of(("", 0)), None),
        (receive_of(None), None),
        (receive_of(("10.0.0.7", 1), raises=True), None),
        (Cycle(object()).receive, None),  # a transport of another kind
        (lambda: None, None),  # a middleware's own receive: the transport is out of reach
    ],
)
def test_the_peer_is_read_from_the_transport_or_unknown(receive: Any, address: str | None) -> None:
    assert transport_peer(receive) == address


def test_forwarding_headers_are_joined_printable_and_bounded() -> None:
    headers = [
        (b"X-Forwarded-For", b"1.2.3.4"),
        (b"host", b"h"),
        (b"forwarded", b"for=5.6.7.8\x1b[31m"),
    ]
    assert forwarded_claim(headers) == "1.2.3.4, for=5.6.7.8?[31m"
    assert forwarded_claim([(b"host", b"h")]) is None
    long = forwarded_claim([(b"x-real-ip", b"9" * 1000)])
    assert long == "9" * MAX_FORWARDED_CHARS + "..."


def test_a_forwarding_header_never_becomes_the_peer() -> None:
    """Without the transport, ``scope["client"]`` is believed only when no header came."""
    forwarded = [(b"x-forwarded-for", b"6.6.6.6")]
    assert request_peer(lambda: None, ("6.6.6.6", 1), forwarded) == Peer(None, "6.6.6.6")
    assert request_peer(lambda: None, ("10.0.0.1", 1), []) == Peer("10.0.0.1", None)
    assert request_peer(lambda: None, None, []) == Peer(None, None)
    # The transport's peer wins over both, and the claim is kept for the audit.
    assert request_peer(receive_of(("127.0.0.1", 9)), ("6.6.6.6", 1), forwarded) == Peer(
        "127.0.0.1", "6.6.6.6"
    )


def test_the_audit_says_unknown_and_what_a_header_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[dict[str, Any]] = []
    monkeypatch.setattr(peer, "log_audit", lambda record: records.append(dict(record)))
    token = FORWARDED_FOR.set("6.6.6.6")
    try:
        audit_with_peer({"action": "sleep", "client": None, "status": 200})
    finally:
        FORWARDED_FOR.reset(token)
    audit_with_peer({"action": "sleep", "client": "10.0.0.1"})
    assert records == [
        {"action": "sleep", "client": "unknown", "forwarded_for": "6.6.6.6", "status": 200},
        {"action": "sleep", "client": "10.0.0.1"},
    ]
    assert list(records[0]) == ["action", "client", "forwarded_for", "status"]  # right after


def test_the_audit_goes_to_the_audit_logger(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="exporter.audit"):
        audit_with_peer({"action": "pause", "client": None})
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("exporter.audit", "admin request pause")
    ]
    assert getattr(caplog.records[0], FIELDS_ATTR) == {"action": "pause", "client": "unknown"}
