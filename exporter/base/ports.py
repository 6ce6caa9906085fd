"""Picking free loopback ports for demos, tests and benchmarks.

A port is free when picked, not when bound: two picks made before either is bound (a fixed
base range, then a handshake port) could name the same port. This process never hands out a
port twice (``_handed_out``; the ports of a range all count), so its own picks never collide.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable
from pathlib import Path

#: Ports this process handed out, forgotten all at once past ``MAX_REMEMBERED``.
_handed_out: set[int] = set()
MAX_REMEMBERED = 4096


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _kernel_port(host: str) -> int:
    """A port the kernel says is free right now (from the ephemeral range)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _hand_out(ports: Iterable[int]) -> None:
    ports = list(ports)
    if len(_handed_out) + len(ports) > MAX_REMEMBERED:
        _handed_out.clear()
    _handed_out.update(ports)


def _unused(host: str, port: int) -> bool:
    """Not handed out by this process before, and bindable now."""
    return port not in _handed_out and _bindable(host, port)


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(host: str, port: int) -> bool:
    with socket.socket(_family(host)) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_listen_port(host: str = "127.0.0.1") -> int:
    """A free port *outside* the ephemeral range, for addresses that are dialled before anything
    binds them (a handshake address): ZMQ reconnecting to an unbound ephemeral loopback port can
    connect to itself (TCP simultaneous open) and then hold the port, so the late bind fails."""
    low, high = _ephemeral_range()
    for _ in range(500):
        port = random.randrange(10000, 65535)
        if not low <= port <= high and _unused(host, port):
            _hand_out([port])
            return port
    port = _kernel_port(host)
    _hand_out([port])
    return port


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base+count-1 are all free right now (for fixed ports)."""
    for _ in range(200):
        base = free_listen_port(host)
        if base + count <= 65535 and all(_unused(host, base + i) for i in range(1, count)):
            _hand_out(range(base, base + count))
            return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def url_host(host: str) -> str:
    """``host`` as a URL names it: an IPv6 address in brackets (``[::1]``), anything else as it
    is. Every URL the exporter prints or hands out is built with it."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def ipv6_loopback() -> bool:
    """Whether this machine can bind ``::1`` (tests and demos skip IPv6 where it cannot)."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True
