"""Socket construction for the ZMQ transports: options, binds (IPv4 and IPv6), monitors.

Every socket the exporter opens gets ``IPV6=1`` (dual stack: it still binds and dials IPv4),
a bounded receive queue and a maximum message size, so that neither an IPv6 deployment nor a
flooding peer needs special handling anywhere else.
"""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from exporter.transport.links import MONITOR_EVENTS, RECV_HWM, ZMQ_MAX_MSG_BYTES, tcp_host


def configure(sock: zmq.Socket[Any], *, linger_ms: int = 0) -> None:
    """The options every exporter socket carries (see the module docstring)."""
    for option, value in (
        (zmq.LINGER, linger_ms),
        (zmq.IPV6, 1),
        (zmq.RCVHWM, RECV_HWM),
        (zmq.SNDHWM, 0),  # sends to engines never block or drop (ROUTER_MANDATORY reports)
        (zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES),
    ):
        sock.setsockopt(option, value)


def plain_socket(ctx: zmq.Context[Any], kind: int) -> zmq.Socket[bytes]:
    """A plain (not zmq.asyncio) socket, driven by ``loop.add_reader`` on its FD."""
    sock: zmq.Socket[bytes] = zmq.Socket(ctx, kind)
    configure(sock)
    return sock


def async_socket(ctx: zmq.asyncio.Context, kind: int, *, linger_ms: int = 0) -> zmq.asyncio.Socket:
    """A zmq.asyncio socket (handshake sockets: a few frames per engine lifetime)."""
    sock = ctx.socket(kind)
    configure(sock, linger_ms=linger_ms)
    return sock


def monitor_socket(ctx: zmq.Context[Any], sock: zmq.Socket[bytes], name: str) -> zmq.Socket[bytes]:
    """A plain PAIR receiving ``sock``'s connection events (not ``get_monitor_socket``, which
    would make a zmq.asyncio socket on this context)."""
    address = f"inproc://exporter-monitor-{name}"
    sock.monitor(address, MONITOR_EVENTS)
    pair: zmq.Socket[bytes] = zmq.Socket(ctx, zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return pair


def bind(sock: zmq.Socket[bytes], bind_host: str, advertise_host: str, port: int | None) -> str:
    """Bind on ``bind_host`` (a kernel-chosen port when ``port`` is None); return the address
    the engines are told, on ``advertise_host``."""
    sock.bind(f"tcp://{tcp_host(bind_host)}:{port if port is not None else '*'}")
    bound_port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    return f"tcp://{tcp_host(advertise_host)}:{bound_port}"
