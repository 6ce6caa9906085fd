"""The exporter's data plane on every engine, shared by owner and relay mode.

One input ROUTER (``ROUTER_MANDATORY``: an unroutable send is an error, not a silent drop;
``ROUTER_HANDOVER``: a restarted engine takes its identity over) and one output PULL *per
engine*: ENGINE_CORE_DEAD carries no engine index, so a per-engine output address is what makes a
death attributable. A socket monitor on each PULL notices an engine's connection closing (a
SIGKILLed engine sends nothing).

These sockets are plain pyzmq sockets driven by ``loop.add_reader`` on their file descriptors and
drained without blocking: one wake-up handles every queued frame, which costs a fraction of a
future per frame (see docs/benchmarks.md). The handshake sockets, which see a few frames per
engine lifetime, stay on ``zmq.asyncio`` in the subclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from exporter.error import HandshakeError, ProtocolError
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    UTILITY_REQUEST_TYPE,
    RegistrationInfo,
    decode_engine_outputs,
    decode_registration,
    engine_identity,
)
from exporter.transport.events import EngineLinkView, ProtocolErrorTally, TransportListener
from exporter.transport.links import (
    MAX_FRAME_BYTES,
    MONITOR_EVENTS,
    NOBLOCK,
    SNDMORE_NOBLOCK,
    ZMQ_MAX_MSG_BYTES,
    EngineLink,
    EngineUnavailable,
    FleetShape,
    Phase,
    recv_message,
    send_frame,
)

__all__ = [
    "MAX_FRAME_BYTES",
    "ZMQ_MAX_MSG_BYTES",
    "EngineDataPlane",
    "EngineLink",
    "EngineUnavailable",
    "FleetShape",
    "Phase",
]

log = logging.getLogger("exporter.transport")


class EngineDataPlane:
    """Input and output sockets of every expected engine, and their link state.

    Subclasses run the handshake (``_start_control`` / ``_close_control``) and move links
    through ``Phase``; this class routes utility frames and reports outputs, deaths and
    (re)connections to the listener.
    """

    def __init__(
        self,
        shape: FleetShape,
        listener: TransportListener,
        errors: ProtocolErrorTally,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.shape = shape
        self._listener = listener
        self._errors = errors
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._links = {idx: self._new_link(idx) for idx in shape.engine_indices}
        self._by_identity = {link.identity: link for link in self._links.values()}
        self._changed = asyncio.Event()
        self._input: zmq.Socket[bytes] | None = None
        self._readers: list[int] = []
        self._input_check_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handshake: zmq.asyncio.Socket | None = None
        self._handshake_task: asyncio.Task[None] | None = None
        self.input_address = ""

    def _new_link(self, engine_index: int) -> EngineLink:
        """Subclasses with more per-engine state return a subclass of ``EngineLink``."""
        return EngineLink(engine_index, engine_identity(engine_index))

    # -- sockets ---------------------------------------------------------------------------

    def _plain_socket(self, kind: int) -> zmq.Socket[bytes]:
        # A plain (not zmq.asyncio) socket on the shared context, driven by add_reader.
        sock: zmq.Socket[bytes] = zmq.Socket(self._ctx, kind)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.RCVHWM, 0),
            (zmq.SNDHWM, 0),
            (zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES),
        ):
            sock.setsockopt(option, value)
        return sock

    def _monitor_socket(self, sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
        """A plain PAIR receiving ``sock``'s connection events (not ``get_monitor_socket``,
        which would make a zmq.asyncio socket on this context)."""
        address = f"inproc://exporter-monitor-{id(self)}-{id(sock)}"
        sock.monitor(address, MONITOR_EVENTS)
        pair: zmq.Socket[bytes] = zmq.Socket(self._ctx, zmq.PAIR)
        pair.setsockopt(zmq.LINGER, 0)
        pair.connect(address)
        return pair

    def _bind(self, sock: zmq.Socket[bytes], port: int | None) -> str:
        """Bind on the bind host; return the address the engines are told (advertise host)."""
        host = self.shape.bind_host or self.shape.advertise_host
        sock.bind(f"tcp://{host}:{port if port is not None else '*'}")
        bound_port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        return f"tcp://{self.shape.advertise_host}:{bound_port}"

    def _watch(self, sock: zmq.Socket[bytes], drain: Callable[[], None]) -> None:
        """Drain ``sock`` whenever its (edge-triggered) FD signals, and once now."""
        assert self._loop is not None
        fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, drain)
        self._readers.append(fd)
        self._loop.call_soon(drain)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind every socket and start receiving; engines may connect from now on."""
        self._loop = asyncio.get_running_loop()
        base = self.shape.fixed_base_port
        self._input = self._plain_socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._input.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.input_address = self._bind(self._input, base)
        for offset, link in enumerate(self._links.values()):
            link.pull = self._plain_socket(zmq.PULL)
            link.output_address = self._bind(link.pull, None if base is None else base + 1 + offset)
            link.monitor = self._monitor_socket(link.pull)
        await self._start_control()
        self._watch(self._input, self._drain_input)
        for link in self._links.values():
            assert link.pull is not None and link.monitor is not None
            self._watch(link.pull, lambda link=link: self._drain_output(link))  # type: ignore[misc]
            self._watch(link.monitor, lambda link=link: self._drain_monitor(link))  # type: ignore[misc]

    async def close(self) -> None:
        """Stop receiving and close every socket with linger 0."""
        await self._close_control()
        if self._loop is not None:
            for fd in self._readers:
                self._loop.remove_reader(fd)
        self._readers.clear()
        for link in self._links.values():
            if link.pull is not None:
                with contextlib.suppress(zmq.ZMQError):
                    link.pull.disable_monitor()
            for sock in (link.monitor, link.pull):
                if sock is not None:
                    sock.close(linger=0)
            link.pull = link.monitor = None
        if self._input is not None:
            self._input.close(linger=0)
            self._input = None
        if self._own_context:
            # A relay's upstream socket closed after READY may still be flushing it.
            await asyncio.to_thread(self._ctx.term)

    async def _start_control(self) -> None:
        """Bind the handshake side (subclasses call ``_open_handshake``)."""

    async def _close_control(self) -> None:
        """Stop the handshake side."""
        await self._close_handshake()

    # -- the handshake socket ------------------------------------------------------------------

    def _open_handshake(self, address: str) -> None:
        """Bind the handshake ROUTER the engines dial, for the life of the process (restarted
        engines handshake again); ``ROUTER_HANDOVER`` lets a restarted engine's new connection
        take its identity over."""
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_MSG_BYTES)
        sock.bind(address)
        self._handshake = sock
        self._handshake_task = asyncio.get_running_loop().create_task(self._handshake_loop(sock))

    async def _close_handshake(self) -> None:
        task, self._handshake_task = self._handshake_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._handshake is not None:
            self._handshake.close(linger=0)
            self._handshake = None

    async def _handshake_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._on_handshake_frames(sock, frames)
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"handshake socket: {exc}")

    async def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """One message on the handshake ROUTER (subclasses)."""

    # -- views -----------------------------------------------------------------------------

    @property
    def engine_indices(self) -> list[int]:
        return list(self._links)

    def link_views(self) -> list[EngineLinkView]:
        return [
            EngineLinkView(
                engine_index=link.engine_index,
                connected=link.phase is Phase.UP and link.slot is not None,
                dead=link.phase is Phase.DEAD,
                handshakes=link.handshakes,
                registration=link.registration,
                output_address=link.output_address,
            )
            for link in self._links.values()
        ]

    def is_callable(self, engine_index: int) -> bool:
        link = self._links[engine_index]
        return link.slot is not None and link.phase in (Phase.UP, Phase.RESTORED)

    def client_index(self, engine_index: int) -> int:
        slot = self._links[engine_index].slot
        if slot is None:
            raise EngineUnavailable(f"engine {engine_index} has no exporter slot")
        return slot

    def connected_count(self) -> int:
        return sum(
            1 for link in self._links.values() if link.phase is Phase.UP and link.slot is not None
        )

    async def wait_connected(self, timeout_s: float, indices: Iterable[int] | None = None) -> None:
        """Wait until every (given) engine is connected; HandshakeError on timeout."""
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

    # -- state changes -----------------------------------------------------------------------

    def _set_phase(self, link: EngineLink, phase: Phase) -> None:
        link.phase = phase
        self._changed.set()

    def _maybe_up(self, link: EngineLink) -> None:
        """READY and the registration travel on different connections: up when both came."""
        if link.phase is Phase.INIT_SENT and link.ready and link.registered:
            self._set_phase(link, Phase.UP)
            log.info("engine %d connected (client_index %s)", link.engine_index, link.slot)
            self._listener.on_engine_up(link.engine_index)

    def _on_dead(self, link: EngineLink) -> None:
        """Hook: an engine announced its death (the relay persists its state)."""

    # -- sending ---------------------------------------------------------------------------

    def send_utility(self, engine_index: int, payload: bytes) -> None:
        """Route a UTILITY payload to one engine; EngineUnavailable when it cannot be sent."""
        if not self.is_callable(engine_index):
            raise EngineUnavailable(f"engine {engine_index} is not connected")
        assert self._input is not None and self._loop is not None
        link = self._links[engine_index]
        try:
            # SNDHWM=0 and ROUTER semantics: never blocks; EHOSTUNREACH when not routable.
            sock = self._input
            send_frame(sock, link.identity, SNDMORE_NOBLOCK)
            send_frame(sock, UTILITY_REQUEST_TYPE, SNDMORE_NOBLOCK)
            send_frame(sock, payload, NOBLOCK)
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"engine {engine_index} is not routable: {exc}") from None
        finally:
            # A send can consume the FD's edge for a registration waiting to be read.
            if not self._input_check_scheduled:
                self._input_check_scheduled = True
                self._loop.call_soon(self._drain_input)

    # -- receiving -------------------------------------------------------------------------

    def _drain_input(self) -> None:
        self._input_check_scheduled = False
        sock = self._input
        while sock is not None and (frames := recv_message(sock)) is not None:
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
        if link.phase is not Phase.INIT_SENT or link.registered or link.slot is None:
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

    def _drain_output(self, link: EngineLink) -> None:
        sock = link.pull
        while sock is not None and (frames := recv_message(sock)) is not None:
            try:
                self._on_output_frames(link, frames)
            except Exception:  # one bad frame must not stop the drain
                log.exception("engine %d: unexpected error handling an output", link.engine_index)

    def _on_output_frames(self, link: EngineLink, frames: list[bytes]) -> None:
        first = frames[0]
        if len(first) > MAX_FRAME_BYTES:
            self._errors.record(
                "oversized_frame", f"engine {link.engine_index}: {len(first)} byte output frame"
            )
            return
        if len(frames) == 1 and first == ENGINE_CORE_DEAD:  # exactly one frame, as vLLM checks
            log.warning("engine %d sent ENGINE_CORE_DEAD", link.engine_index)
            self._set_phase(link, Phase.DEAD)
            self._on_dead(link)
            self._listener.on_engine_down(link.engine_index, "dead")
            return
        if len(frames) > 1:
            self._errors.record(
                "extra_frames", f"engine {link.engine_index}: {len(frames)} output frames"
            )
        try:
            output = decode_engine_outputs(first)
        except ProtocolError as exc:
            self._errors.record(exc.kind, f"engine {link.engine_index} output: {exc}")
            return
        if output.engine_index != link.engine_index:
            self._errors.record(
                "wrong_engine_index",
                f"output socket of engine {link.engine_index} carried engine_index "
                f"{output.engine_index}",
            )
            return
        if link.phase is Phase.RESTORED:
            # A restarted exporter on fixed addresses: the engine reconnected on its own.
            log.info("engine %d reattached without a handshake", link.engine_index)
            self._set_phase(link, Phase.UP)
            self._listener.on_engine_up(link.engine_index)
        self._listener.on_output(link.engine_index, output)

    def _drain_monitor(self, link: EngineLink) -> None:
        """An engine's output connection closing means its process died or restarted: fail its
        calls in flight at once instead of at their timeout (a SIGKILL sends no sentinel).

        Any peer can connect to an output address. Connections are tracked by file descriptor,
        and only the close of the *last* one counts as the engine going away: a stray or
        hostile peer hanging up must not fail the engine's calls. (While such a peer stays
        connected, a SIGKILLed engine is noticed by its call timeout instead.)
        """
        sock = link.monitor
        while sock is not None and (frames := recv_message(sock)) is not None:
            try:
                event = parse_monitor_message(frames)
            except Exception:  # a malformed monitor frame is not actionable
                continue
            fd = int(event.get("value", -1))
            if event.get("event") == zmq.EVENT_ACCEPTED:
                link.live_peers.add(fd)
                continue
            link.live_peers.discard(fd)
            if link.live_peers:
                log.info("engine %d: a peer of its output socket hung up", link.engine_index)
            elif link.phase is Phase.UP:
                log.warning("engine %d: output connection closed", link.engine_index)
                self._listener.on_engine_down(link.engine_index, "disconnected")
