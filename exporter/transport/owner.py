"""Owner mode: the exporter owns the start-up handshake of headless engines, as vLLM's Rust
front end does in ``HandshakeOwner`` mode.

Sockets: one handshake ROUTER (bound for the life of the process, so restarted engines can
handshake again), one input ROUTER with ``ROUTER_MANDATORY`` (an unroutable send is an error,
not a silent drop), and one output PULL *per engine*: ENGINE_CORE_DEAD carries no engine index,
so a per-engine output address is what makes a death attributable.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from exporter.error import HandshakeError, ProtocolError
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    HELLO,
    READY,
    UTILITY_REQUEST_TYPE,
    RegistrationInfo,
    decode_engine_outputs,
    decode_handshake_message,
    decode_registration,
    encode_init,
    engine_identity,
)
from exporter.transport.events import EngineLinkView, ProtocolErrorTally, TransportListener

log = logging.getLogger("exporter.transport")

#: Frames above this are dropped and counted as ``oversized_frame`` before any decoding.
MAX_FRAME_BYTES = 1024 * 1024
#: Hard limit enforced by ZMQ itself: a peer sending more is disconnected.
ZMQ_MAX_MSG_BYTES = 16 * 1024 * 1024
#: Monitor events that mean an engine's output connection is gone (process died or restarted).
_GONE_EVENTS = zmq.EVENT_DISCONNECTED


class Phase(enum.Enum):
    IDLE = "idle"  # no HELLO seen (or reattaching on fixed addresses)
    INIT_SENT = "init_sent"  # HELLO answered, waiting for READY and registration
    UP = "up"  # READY and registration both received
    DEAD = "dead"  # ENGINE_CORE_DEAD received; a new HELLO revives it


@dataclass
class OwnerConfig:
    """Addresses and fleet shape for owner mode."""

    handshake_address: str
    engine_count: int
    start_rank: int = 0
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    #: Fixed ports: input ROUTER at ``fixed_base_port``, engine offset i's PULL at base+1+i.
    #: With fixed ports a restarted exporter reattaches to engines that reconnect on their own.
    fixed_base_port: int | None = None

    def __post_init__(self) -> None:
        if self.engine_count < 1:
            raise ValueError("engine_count must be at least 1")
        if self.start_rank < 0 or self.start_rank + self.engine_count > 0x10000:
            raise ValueError("engine ranks must fit in 0..65535")

    @property
    def engine_indices(self) -> range:
        return range(self.start_rank, self.start_rank + self.engine_count)


@dataclass
class _Link:
    engine_index: int
    identity: bytes
    output_address: str = ""
    phase: Phase = Phase.IDLE
    ready: bool = False
    registered: bool = False
    handshakes: int = 0
    registration: RegistrationInfo | None = None
    reattachable: bool = False
    pull: zmq.asyncio.Socket | None = field(default=None, repr=False)


class EngineUnavailable(Exception):
    """The engine cannot be sent to (not handshaken, dead, or not routable)."""


class OwnerTransport:
    """Binds the sockets, runs the handshake for every expected engine, routes frames."""

    def __init__(
        self,
        config: OwnerConfig,
        listener: TransportListener,
        errors: ProtocolErrorTally,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self._listener = listener
        self._errors = errors
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._links = {idx: _Link(idx, engine_identity(idx)) for idx in config.engine_indices}
        self._by_identity = {link.identity: link for link in self._links.values()}
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[zmq.asyncio.Socket] = []
        self._changed = asyncio.Event()
        self.input_address = ""
        self._handshake: zmq.asyncio.Socket | None = None
        self._input: zmq.asyncio.Socket | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        self._sockets.append(sock)
        return sock

    def _bind(self, sock: zmq.asyncio.Socket, port: int | None) -> str:
        host = self.config.bind_host or self.config.advertise_host
        sock.bind(f"tcp://{host}:{port if port is not None else '*'}")
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        bound_port = bound.rsplit(":", 1)[1]
        return f"tcp://{self.config.advertise_host}:{bound_port}"

    async def start(self) -> None:
        """Bind every socket and start the receive loops; engines may connect from now on."""
        base = self.config.fixed_base_port
        self._input = self._socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A restarted engine reconnects with the same identity, possibly before its old
        # connection is noticed as gone: let the new connection take the identity over.
        self._input.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.input_address = self._bind(self._input, base)
        for offset, link in enumerate(self._links.values()):
            link.pull = self._socket(zmq.PULL)
            link.output_address = self._bind(link.pull, None if base is None else base + 1 + offset)
            link.reattachable = base is not None
        self._handshake = self._socket(zmq.ROUTER)
        self._handshake.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._handshake.bind(self.config.handshake_address)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._handshake_loop(self._handshake)))
        self._tasks.append(loop.create_task(self._input_loop(self._input)))
        for link in self._links.values():
            assert link.pull is not None
            self._tasks.append(loop.create_task(self._output_loop(link, link.pull)))
            monitor = link.pull.get_monitor_socket(_GONE_EVENTS)
            self._sockets.append(monitor)
            self._tasks.append(loop.create_task(self._monitor_loop(link, monitor)))

    async def close(self) -> None:
        """Stop the loops and close every socket with linger 0."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for sock in self._sockets:
            if sock.type == zmq.PULL:
                with contextlib.suppress(zmq.ZMQError):
                    sock.disable_monitor()
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        if self._own_context:
            self._ctx.term()

    # -- views -----------------------------------------------------------------------------

    @property
    def engine_indices(self) -> list[int]:
        return list(self._links)

    def link_views(self) -> list[EngineLinkView]:
        return [
            EngineLinkView(
                engine_index=link.engine_index,
                connected=link.phase is Phase.UP,
                dead=link.phase is Phase.DEAD,
                handshakes=link.handshakes,
                registration=link.registration,
                output_address=link.output_address,
            )
            for link in self._links.values()
        ]

    def is_callable(self, engine_index: int) -> bool:
        link = self._links[engine_index]
        return link.phase is Phase.UP or (link.phase is Phase.IDLE and link.reattachable)

    def client_index(self, engine_index: int) -> int:
        """The exporter is the only client in owner mode: slot 0."""
        return 0

    def connected_count(self) -> int:
        return sum(1 for link in self._links.values() if link.phase is Phase.UP)

    async def wait_connected(self, timeout_s: float, indices: Iterable[int] | None = None) -> None:
        """Wait until every (given) engine finished its handshake; HandshakeError on timeout."""
        wanted = list(self._links if indices is None else indices)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            missing = [i for i in wanted if self._links[i].phase is not Phase.UP]
            if not missing:
                return
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise HandshakeError(
                    f"engines {missing} did not complete the handshake within {timeout_s:g}s"
                )
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    # -- sending ---------------------------------------------------------------------------

    def send_utility(self, engine_index: int, payload: bytes) -> None:
        """Route a UTILITY payload to one engine; EngineUnavailable when it cannot be sent."""
        if not self.is_callable(engine_index):
            raise EngineUnavailable(f"engine {engine_index} is not connected")
        assert self._input is not None
        link = self._links[engine_index]
        try:
            # SNDHWM=0 and ROUTER semantics: this never blocks; EHOSTUNREACH when not routable.
            self._input.send_multipart(
                [link.identity, UTILITY_REQUEST_TYPE, payload], flags=zmq.NOBLOCK, copy=True
            )
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"engine {engine_index} is not routable: {exc}") from None

    # -- receive loops ---------------------------------------------------------------------

    def _set_phase(self, link: _Link, phase: Phase) -> None:
        link.phase = phase
        self._changed.set()

    async def _handshake_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self._on_handshake_frames(sock, frames)
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"handshake socket: {exc}")

    def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ProtocolError("wrong_frame_count", f"{len(frames)} frames on handshake socket")
        identity, payload = frames
        link = self._by_identity.get(identity)
        if link is None:
            raise ProtocolError("unknown_identity", f"handshake from identity {identity.hex()}")
        message = decode_handshake_message(payload)
        if message.status == HELLO:
            if message.local or not message.headless:
                raise ProtocolError(
                    "unexpected_hello_flags",
                    f"engine {link.engine_index} HELLO local={message.local} "
                    f"headless={message.headless}; only --headless engines can attach",
                )
            if link.phase is Phase.INIT_SENT:
                raise ProtocolError(
                    "duplicate_hello",
                    f"engine {link.engine_index} sent HELLO while its handshake is in progress",
                )
            if link.phase in (Phase.UP, Phase.DEAD) or link.handshakes:
                log.warning("engine %d restarted: handshaking again", link.engine_index)
                self._listener.on_engine_down(link.engine_index, "restarted")
            link.ready = link.registered = False
            link.reattachable = False
            link.handshakes += 1
            init = encode_init([self.input_address], [link.output_address])
            sock.send_multipart([identity, init], flags=zmq.NOBLOCK)
            self._set_phase(link, Phase.INIT_SENT)
            log.info("engine %d: HELLO answered with INIT", link.engine_index)
        elif message.status == READY:
            if link.phase is not Phase.INIT_SENT or link.ready:
                raise ProtocolError(
                    "unexpected_ready", f"engine {link.engine_index} sent READY out of order"
                )
            link.ready = True
            self._maybe_up(link)
        else:
            raise ProtocolError(
                "unexpected_status", f"engine {link.engine_index} sent status {message.status!r}"
            )

    async def _input_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                self._on_input_frames(frames)
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"input socket: {exc}")

    def _on_input_frames(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ProtocolError("wrong_frame_count", f"{len(frames)} frames on input socket")
        identity, payload = frames
        link = self._by_identity.get(identity)
        if link is None:
            raise ProtocolError(
                "unknown_identity", f"registration from unexpected identity {identity.hex()}"
            )
        if link.phase is not Phase.INIT_SENT or link.registered:
            raise ProtocolError(
                "unexpected_registration",
                f"engine {link.engine_index} registered outside its handshake",
            )
        link.registered = True
        try:
            link.registration = decode_registration(payload)
        except ProtocolError as exc:
            link.registration = RegistrationInfo()
            self._errors.record(exc.kind, f"engine {link.engine_index} registration: {exc}")
        self._maybe_up(link)

    def _maybe_up(self, link: _Link) -> None:
        if link.ready and link.registered:
            self._set_phase(link, Phase.UP)
            log.info("engine %d connected", link.engine_index)
            self._listener.on_engine_up(link.engine_index)

    async def _monitor_loop(self, link: _Link, monitor: zmq.asyncio.Socket) -> None:
        """An engine's output connection closing means its process died or restarted: fail its
        calls in flight at once instead of at their timeout (a SIGKILL sends no sentinel)."""
        while True:
            frames = await monitor.recv_multipart()
            if link.phase is Phase.UP and len(frames) >= 1:
                log.warning("engine %d: output connection closed", link.engine_index)
                self._listener.on_engine_down(link.engine_index, "disconnected")

    async def _output_loop(self, link: _Link, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            sizes = [len(f) for f in frames]
            if sizes[0] > MAX_FRAME_BYTES:
                self._errors.record(
                    "oversized_frame", f"engine {link.engine_index}: {sizes[0]} byte output frame"
                )
                continue
            first = frames[0].bytes
            if first == ENGINE_CORE_DEAD:
                log.warning("engine %d sent ENGINE_CORE_DEAD", link.engine_index)
                self._set_phase(link, Phase.DEAD)
                link.reattachable = False
                self._listener.on_engine_down(link.engine_index, "dead")
                continue
            if len(frames) > 1:
                self._errors.record(
                    "extra_frames", f"engine {link.engine_index}: {len(frames)} output frames"
                )
            try:
                output = decode_engine_outputs(first)
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"engine {link.engine_index} output: {exc}")
                continue
            if output.engine_index != link.engine_index:
                self._errors.record(
                    "wrong_engine_index",
                    f"output socket of engine {link.engine_index} carried engine_index "
                    f"{output.engine_index}",
                )
                continue
            if link.phase is Phase.IDLE and link.reattachable:
                # A restarted exporter on fixed addresses: the engine reconnected on its own.
                log.info("engine %d reattached without a handshake", link.engine_index)
                self._set_phase(link, Phase.UP)
                self._listener.on_engine_up(link.engine_index)
            self._listener.on_output(link.engine_index, output)
