"""The output side of the data plane: one PULL for every engine, its connection monitor, and
which engine each message belongs to.

The PULL is bound on a separate address *per engine*: ENGINE_CORE_DEAD carries no engine index,
so the address an engine's connection came in on is what makes a death attributable. One socket
monitor on that PULL reports each connection's file descriptor and local address when it is
accepted and when it closes (a SIGKILLed engine sends nothing); ``ZMQ_SRCFD`` ties every message
to its connection, so every message is attributed to the engine whose address it arrived on.
Which connection is the engine's own, and which close means it is gone, is decided by the pure
``is_engine_connection`` and ``engine_connection_closed`` (``links``).
"""

from __future__ import annotations

import abc
import asyncio
import logging

import zmq
from zmq.utils.monitor import parse_monitor_message

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.events import TransportListener
from exporter.client.enginecore.links import (
    DRAIN_BATCH,
    MAX_FRAME_BYTES,
    EngineLink,
    FleetShape,
    Phase,
    engine_connection_closed,
    is_engine_connection,
    port_of,
    recv_message,
    recv_message_fd,
)
from exporter.client.enginecore.linkstate import CALLABLE, LinkTable
from exporter.error import ProtocolError
from exporter.protocol import ENGINE_CORE_DEAD, decode_engine_outputs

log = logging.getLogger("exporter.transport")


class OutputReader(LinkTable, abc.ABC):
    """Drains the shared output PULL and its monitor, attributes every message and every
    connection to one engine, and reports outputs, deaths and (re)connections to the listener.
    ``EngineDataPlane`` binds the sockets and decides what a confirmed death does."""

    def __init__(
        self, shape: FleetShape, listener: TransportListener, faults: ProtocolErrorTally
    ) -> None:
        super().__init__(shape)
        self._listener = listener
        self._faults = faults
        self._loop: asyncio.AbstractEventLoop | None = None
        #: One PULL bound on every engine's output address, and its connection monitor.
        self._output: zmq.Socket[bytes] | None = None
        self._output_monitor: zmq.Socket[bytes] | None = None
        #: Output port → engine (each engine has its own), live connection fd → engine.
        self._by_port: dict[int, EngineLink] = {}
        self._by_fd: dict[int, EngineLink] = {}
        #: Closed connections' engines, until the descriptor number is reused (bounded by the
        #: process's descriptor limit).
        self._closed_by_fd: dict[int, EngineLink] = {}

    @abc.abstractmethod
    def confirm_dead(self, engine_index: int) -> None:
        """The engine is dead (its ENGINE_CORE_DEAD was believed or confirmed): stop calling it."""

    def _drain_output(self, woken: bool = False) -> None:
        """Handle what the output socket has queued (``woken``: its FD signalled, so the first
        receive skips the ``ZMQ_EVENTS`` probe), each message as from the engine whose address
        its connection came in on (``_sender``)."""
        sock = self._output
        probe = not woken
        for _ in range(DRAIN_BATCH):
            received = recv_message_fd(sock, probe=probe) if sock is not None else None
            probe = True
            if received is None:
                return
            frames, fd = received
            try:
                self._on_output_frames(self._sender(fd), frames, fd)
            except ProtocolError as exc:
                self._faults.record(exc.kind, f"output socket: {exc}")
            except Exception as exc:  # a bug must not stop the reader: count it, go on
                self._faults.task_failed("output_reader", exc)
        assert self._loop is not None
        self._loop.call_soon(self._drain_output)  # a flood: yield, then continue

    def _sender(self, fd: int) -> EngineLink:
        """The engine whose output address connection ``fd`` came in on. libzmq reports a
        connection to the monitor before any of its messages, so a connection not known yet
        first reads the monitor; a connection closed since the message was queued is still
        attributed (``_closed_by_fd``, until its descriptor number is reused)."""
        link = self._by_fd.get(fd) or self._closed_by_fd.get(fd)
        if link is None:
            self._drain_monitor(limit=None)
            link = self._by_fd.get(fd) or self._closed_by_fd.get(fd)
        if link is None:
            raise ProtocolError("unknown_connection", f"a message from unknown connection {fd}")
        return link

    def _on_output_frames(self, link: EngineLink, frames: list[bytes], fd: int) -> None:
        first = frames[0]
        if len(first) > MAX_FRAME_BYTES:
            raise ProtocolError(
                "oversized_frame", f"engine {link.engine_index}: {len(first)} byte output frame"
            )
        if len(frames) == 1 and first == ENGINE_CORE_DEAD:  # exactly one frame, as vLLM checks
            self._on_engine_core_dead(link, fd)
            return
        if len(frames) > 1:
            self._faults.record(
                "extra_frames", f"engine {link.engine_index}: {len(frames)} output frames"
            )
        output = decode_engine_outputs(first)
        if output.engine_index != link.engine_index:
            raise ProtocolError(
                "wrong_engine_index",
                f"output address of engine {link.engine_index} carried engine_index "
                f"{output.engine_index}",
            )
        if link.phase is Phase.RESTORED:
            # A restarted exporter on fixed addresses, or a reconnection: the engine is back.
            log.info("engine %d reattached without a handshake", link.engine_index)
            self._set_phase(link, Phase.UP)
            self._listener.on_engine_up(link.engine_index, handshaken=False)
        if self._listener.on_output(link.engine_index, output) and fd >= 0:
            link.engine_fd = fd  # it answered one of our calls: this connection is the engine

    def _on_engine_core_dead(self, link: EngineLink, fd: int) -> None:
        """Believe ENGINE_CORE_DEAD at once only from the engine's own connection
        (``is_engine_connection``); a claim from elsewhere goes to the listener to confirm."""
        if link.phase not in CALLABLE:
            return
        if is_engine_connection(link, fd):
            self.confirm_dead(link.engine_index)
        else:
            self._listener.on_death_claimed(link.engine_index)

    def _drain_monitor(self, limit: int | None = DRAIN_BATCH) -> None:
        """An engine's output connection closing means its process died or restarted: the
        engine is LOST (not connected, its calls in flight fail at once instead of at their
        timeout: a SIGKILL sends no sentinel). A new connection makes it callable, and
        connected, again (RESTORED: ``links.is_connected``); it is UP once it answers.
        Which closes count: ``engine_connection_closed``. ``limit``: events handled before
        yielding (None: until none is queued, to judge a message on the current mapping)."""
        sock = self._output_monitor
        handled = 0
        while limit is None or handled < limit:
            frames = recv_message(sock) if sock is not None else None
            if frames is None:
                return
            handled += 1
            try:
                event = parse_monitor_message(frames)
                kind, fd = int(event.get("event", 0)), int(event.get("value", -1))
                port = port_of(bytes(event.get("endpoint", b"")).decode("ascii", "replace"))
            except (ValueError, IndexError, TypeError):  # a malformed event is not actionable
                continue
            link = self._by_port.get(port)
            if link is None:
                continue
            if kind == zmq.EVENT_ACCEPTED:
                self._by_fd[fd] = link
                self._closed_by_fd.pop(fd, None)
            elif self._by_fd.get(fd) is link:
                del self._by_fd[fd]
                self._closed_by_fd[fd] = link  # its last messages may still be queued
            self._on_connection_event(link, kind, fd)
        assert self._loop is not None
        self._loop.call_soon(self._drain_monitor)

    def _on_connection_event(self, link: EngineLink, event: int, fd: int) -> None:
        if event == zmq.EVENT_ACCEPTED:
            link.live_peers.add(fd)
            if link.phase is Phase.LOST:
                self._set_phase(link, Phase.RESTORED)  # UP again once it answers
            return
        link.live_peers.discard(fd)
        if not engine_connection_closed(link, fd):
            log.info("engine %d: a peer of its output socket hung up", link.engine_index)
            return
        link.engine_fd = None
        if link.phase in CALLABLE:
            log.warning("engine %d: output connection closed", link.engine_index)
            self._set_phase(link, Phase.LOST)
            self._listener.on_engine_down(link.engine_index, "disconnected")
