"""Per-engine link state and the raw-socket helpers of the data plane (no I/O loops here)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import zmq
import zmq.backend

from exporter.protocol import RegistrationInfo
from exporter.protocol.pushes import FaultStatus

#: Frames above this are dropped and counted as ``oversized_frame`` before any decoding.
MAX_FRAME_BYTES = 1024 * 1024
#: Hard limit enforced by ZMQ itself: a peer sending more is disconnected.
ZMQ_MAX_MSG_BYTES = 4 * 1024 * 1024
#: Messages ZMQ queues per connection before it stops reading from that peer (TCP then pushes
#: back on the sender): a flooding peer costs at most this many messages of memory.
RECV_HWM = 256
#: Messages one reader handles per event-loop turn before it yields (and reschedules itself):
#: a flooding peer cannot keep /metrics, polls or other engines' readers waiting.
DRAIN_BATCH = 256
#: Monitor events of an output PULL: its peers connecting and going away. A PULL's peers are
#: normally just its engine; when the last one goes, the engine died or restarted.
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


# The hot path calls the Cython socket methods with plain int flags: pyzmq's Python wrappers
# and enum flags cost more per frame than the send itself (docs/benchmarks/README.md, "Profile").
NOBLOCK, SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
send_frame = cast(Callable[..., None], zmq.backend.Socket.send)
recv_frame = cast(Callable[..., zmq.Frame], zmq.backend.Socket.recv)
get_option = cast(Callable[..., int], zmq.backend.Socket.get)
EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def recv_message(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    """The next message's frames, or None when nothing is queued (``recv_message_fd``)."""
    received = recv_message_fd(sock)
    return None if received is None else received[0]


def recv_message_fd(
    sock: zmq.Socket[bytes], *, probe: bool = True
) -> tuple[list[bytes], int] | None:
    """The next message's frames and the file descriptor of the connection it came from
    (``ZMQ_SRCFD``; -1 when unknown, which tells an engine's own connection from a stranger's),
    or None when nothing is queued.

    ZMQ's FD is edge-triggered: a reader drains until nothing is queued (``ZMQ_EVENTS`` without
    POLLIN, or EAGAIN, both of which re-arm the FD), or reschedules itself when it stops early.
    With ``probe`` (the default) ``ZMQ_EVENTS`` is asked before the receive, because an EAGAIN
    costs pyzmq an exception object (``zmq.Again``, dearer than the probe); a reader woken by its
    FD passes ``probe=False`` for its first receive, which then almost always finds a message and
    saves the ``ZMQ_EVENTS`` call (a ``poll`` system call in libzmq plus pyzmq's option lookup).
    What each costs: ``python -m bench.hotpath``, docs/scale.md. Frames are received without
    copy so that ``more`` needs no ZMQ_RCVMORE getsockopt."""
    if probe and not get_option(sock, EVENTS) & POLLIN:
        return None
    try:
        frame = recv_frame(sock, NOBLOCK, copy=False)
    except zmq.Again:
        return None
    try:
        fd = int(frame.get(SRCFD))
    except (zmq.ZMQError, ValueError, TypeError):
        fd = -1
    frames = [frame.bytes]
    while frame.more:
        frame = recv_frame(sock, NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames, fd


#: ``zmq_msg_get(ZMQ_SRCFD)``: deprecated in libzmq but present in every 4.x release.
SRCFD = int(getattr(zmq, "SRCFD", 2))
#: ``zmq_msg_gets``' property naming the remote address of a TCP connection (libzmq >= 4.1).
PEER_ADDRESS = "Peer-Address"


def recv_message_peer(sock: zmq.Socket[bytes]) -> tuple[list[bytes], str | None] | None:
    """The next message's frames and the remote address of the connection it came from
    (``Peer-Address``: ``10.0.0.5``, ``::1``; None over ipc or when libzmq does not say), or
    None when nothing is queued. For the input ROUTER's registrations (a few per engine
    lifetime): the address is the engine's host, which fills a wildcard KV-events endpoint."""
    if not get_option(sock, EVENTS) & POLLIN:
        return None
    try:
        frame = recv_frame(sock, NOBLOCK, copy=False)
    except zmq.Again:
        return None
    try:
        peer: str | None = str(frame.get(PEER_ADDRESS))
    except (zmq.ZMQError, ValueError, TypeError):
        peer = None
    frames = [frame.bytes]
    while frame.more:
        frame = recv_frame(sock, NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames, peer


def port_of(address: str) -> int:
    """The port of a ``tcp://HOST:PORT`` address (IPv6 hosts in brackets); ValueError else."""
    _, colon, port = address.rpartition(":")
    if not colon:
        raise ValueError(f"no port in {address!r}")
    return int(port)


def tcp_host(host: str) -> str:
    """A host as it goes into a ``tcp://`` endpoint: IPv6 literals in brackets."""
    host = host.strip("[]")
    return f"[{host}]" if ":" in host else host


class Phase(enum.Enum):
    IDLE = "idle"  # no handshake seen
    HELLO_SENT = "hello_sent"  # relay: HELLO forwarded upstream, waiting for the front end's INIT
    INIT_SENT = "init_sent"  # INIT delivered, waiting for READY and the registration
    UP = "up"  # READY and registration both received
    RESTORED = "restored"  # reattaching without a handshake; UP once the engine answers
    LOST = "lost"  # was up, its output connection closed; RESTORED when it reconnects
    DEAD = "dead"  # ENGINE_CORE_DEAD received; a new HELLO revives it
    REFUSED = "refused"  # handshaken, but the exporter cannot serve it (see EngineLink.refused)


@dataclass
class FleetShape:
    """Which engines, and where the data-plane sockets bind."""

    engine_count: int
    start_rank: int = 0
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    #: Fixed ports: input ROUTER at ``fixed_base_port``, engine offset i's PULL at base+1+i.
    #: With fixed ports a restarted exporter reattaches to engines that reconnect on their own.
    fixed_base_port: int | None = None
    #: Where to remember engines (slots, registrations) across exporter restarts.
    state_file: str | None = None

    def __post_init__(self) -> None:
        self.advertise_host = self.advertise_host.strip("[]")
        if self.bind_host is not None:
            self.bind_host = self.bind_host.strip("[]")
        if self.engine_count < 1:
            raise ValueError("engine_count must be at least 1")
        if self.start_rank < 0 or self.start_rank + self.engine_count > 0x10000:
            raise ValueError("engine ranks must fit in 0..65535")

    @property
    def engine_indices(self) -> range:
        return range(self.start_rank, self.start_rank + self.engine_count)


@dataclass
class EngineLink:
    """One engine as the exporter sees it."""

    engine_index: int
    identity: bytes
    output_address: str = ""
    phase: Phase = Phase.IDLE
    #: The exporter's client_index on this engine; None while it has no slot.
    slot: int | None = None
    ready: bool = False
    registered: bool = False
    handshakes: int = 0
    registration: RegistrationInfo | None = None
    refused: str | None = None
    #: READY carried ``parallel_config_hash``: a coordinated (MoE) DP engine.
    coordinated: bool = False
    #: The connections (file descriptors) open on this engine's output address.
    live_peers: set[int] = field(default_factory=set, repr=False)
    #: The connection that delivered a reply to one of our calls: the engine's own.
    engine_fd: int | None = field(default=None, repr=False)
    #: Its last fault-tolerance status (owner mode: what it pushed, recorded by the client),
    #: kept in the state file: an engine pushes only on change, never again after a restart.
    fault_status: FaultStatus | None = None


def is_engine_connection(link: EngineLink, fd: int) -> bool:
    """Whether connection ``fd`` to the engine's output address is the engine's own: the one that
    answered our calls, or, before any answer, the only connection there is. Anyone can connect
    to an output address, so only this connection's ENGINE_CORE_DEAD is believed at once."""
    known = link.engine_fd
    return fd >= 0 and (fd == known or (known is None and link.live_peers == {fd}))


def is_connected(link: EngineLink) -> bool:
    """Whether the engine counts as connected (``/status`` ``connected``, what *hung* needs):
    handshaken and up, or restored (reattached after an exporter restart without a handshake)
    while the socket monitor shows a connection accepted on its output address. A restored
    engine is not up before it answers; only this changes, so a silent one reads hung, not
    disconnected. Either way it needs a slot the exporter can call it on."""
    if link.slot is None:
        return False
    return link.phase is Phase.UP or (link.phase is Phase.RESTORED and bool(link.live_peers))


def engine_connection_closed(link: EngineLink, fd: int) -> bool:
    """Whether connection ``fd`` closing (already out of ``live_peers``) means the engine is gone:
    its own connection once known, else the last connection (a stranger hanging up must not
    fail the engine)."""
    return fd == link.engine_fd if link.engine_fd is not None else not link.live_peers
