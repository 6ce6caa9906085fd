"""Socket construction for the ZMQ transports: options, binds (IPv4 and IPv6), monitors.

Every socket the exporter opens gets ``IPV6=1`` (dual stack: it still binds and dials IPv4),
a bounded receive queue and a maximum message size, so that neither an IPv6 deployment nor a
flooding peer needs special handling anywhere else.
"""

from __future__ import annotations

import asyncio
import errno
import resource
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from exporter.client.enginecore.links import MONITOR_EVENTS, RECV_HWM, ZMQ_MAX_MSG_BYTES, tcp_host
from exporter.error import ConfigError

#: ZMQ sockets per engine: none. One output PULL is bound on every engine's address and one
#: monitor watches it (docs/scale.md); only the relay adds an upstream DEALER per engine while
#: that engine's handshake is relayed.
SOCKETS_PER_ENGINE = 0
#: Sockets that do not depend on the engine count: input ROUTER, handshake ROUTER, output PULL,
#: the PAIR receiving its monitor events and the monitor's own end inside libzmq, plus slack for
#: sockets a test or the relay's upstream handshake opens on the same context.
SOCKETS_BASE = 16
#: File descriptors per engine, measured (docs/scale.md, ``python -m bench.scale``): the
#: listening socket of its output address, its connection to it and its connection to the
#: input ROUTER.
FDS_PER_ENGINE = 3
#: How long a fixed address found in use is retried before start fails: the listener of an
#: exporter that just stopped can outlive it briefly (libzmq closes sockets on its I/O thread,
#: and a replaced process may still be exiting).
ADDRESS_IN_USE_WAIT_S = 3.0

T = TypeVar("T")
#: Descriptors that do not depend on the engine count: the interpreter, libzmq's threads and
#: epoll, asyncio, the HTTP listeners and their clients (scrapes, admin), and slack.
FDS_BASE = 256


def sockets_needed(engine_count: int, *, per_engine: int = SOCKETS_PER_ENGINE) -> int:
    """ZMQ sockets a data plane over ``engine_count`` engines opens on its context."""
    return per_engine * engine_count + SOCKETS_BASE


def descriptors_needed(engine_count: int, *, per_engine: int = FDS_PER_ENGINE) -> int:
    """Open files the exporter process needs with every engine connected."""
    return per_engine * engine_count + FDS_BASE


def raise_max_sockets(ctx: zmq.Context[Any], needed: int) -> None:
    """Raise the context's socket limit (libzmq's default is 1,023) to ``needed``.

    libzmq reads ``ZMQ_MAX_SOCKETS`` when the context creates its first socket: call this on a
    fresh context. A value above ``ZMQ_SOCKET_LIMIT`` is a configuration that cannot work."""
    if ctx.get(zmq.MAX_SOCKETS) >= needed:
        return
    limit = int(ctx.get(zmq.SOCKET_LIMIT))
    if needed > limit:
        raise ConfigError(
            f"the engine count needs {needed} ZMQ sockets, above libzmq's limit of {limit} "
            "per context: run one exporter per smaller group of engines"
        )
    ctx.set(zmq.MAX_SOCKETS, needed)


def ensure_open_files(needed: int) -> None:
    """Make sure the process may open ``needed`` files: raise the soft RLIMIT_NOFILE up to the
    hard limit when it is lower; ConfigError (one line: how many, how to raise them) when even
    the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise ConfigError(
            f"the configured engine count needs about {needed} open files but the limit is "
            f"{soft} (hard {hard}): raise the hard limit to at least {needed} (ulimit -n; systemd "
            "LimitNOFILE=; Kubernetes: the container runtime's nofile limit, which no "
            "securityContext field sets) or run fewer engines per exporter"
        )
    resource.setrlimit(
        resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else needed, hard)
    )


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


async def bind_when_free(bind_once: Callable[[], T], wait_s: float = ADDRESS_IN_USE_WAIT_S) -> T:
    """``bind_once()``, retried while its address is in use for at most ``wait_s``; any other
    error, or the address still in use after that, is raised as it is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return bind_once()
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or loop.time() >= deadline:
                raise
        await asyncio.sleep(0.05)
