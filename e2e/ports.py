"""Free loopback ports for the suite, outside the kernel's ephemeral range.

A copy of the exporter's rule on purpose (the suite is black-box and must not break when
``exporter/`` is refactored): addresses that are dialled before anything binds them (handshake
ports) must not be ephemeral, or a ZMQ reconnect loop can connect to itself and hold the port.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


_handed_out: set[int] = set()


def free_port_range(count: int = 1) -> int:
    """A base port such that ``base .. base+count-1`` are free now and were never handed out
    by this process before (two fixtures asking in a row must not get the same port)."""
    low, high = _ephemeral_range()
    for _ in range(2000):
        base = random.randrange(10000, 65535 - count)
        span = range(base, base + count)
        if any(low <= p <= high or p in _handed_out for p in span):
            continue
        if all(_bindable(p) for p in span):
            _handed_out.update(span)
            return base
    raise RuntimeError(f"no {count} consecutive free ports outside the ephemeral range")


def free_port() -> int:
    """One free port outside the ephemeral range."""
    return free_port_range(1)
