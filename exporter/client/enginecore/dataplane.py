"""The exporter's data plane on every engine, shared by owner and relay mode.

One input ROUTER (``ROUTER_MANDATORY``: an unroutable send is an error, not a silent drop;
``ROUTER_HANDOVER``: a restarted engine takes its identity over) and one output PULL bound on a
separate address *per engine*, read with its connection monitor by ``OutputReader``
(``output``: which engine every message and every closed connection belongs to). One socket
for every engine (not one each) is what vLLM's front end does: one wake-up and one
``ZMQ_EVENTS`` probe per batch of replies instead of per engine (docs/scale.md).

These sockets are plain pyzmq sockets driven by ``loop.add_reader`` on their file descriptors.
Each reader handles at most ``DRAIN_BATCH`` messages per event-loop turn and then yields, and
every socket's receive queue is bounded (``RECV_HWM``): a flooding peer is throttled by TCP back
pressure instead of freezing the loop or growing memory. The handshake socket, which sees a few
frames per engine lifetime, stays on ``zmq.asyncio`` (``HandshakeSocket``).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any, cast

import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore import sockets
from exporter.client.enginecore.events import TransportListener, UnexpectedEngines
from exporter.client.enginecore.handshake_socket import HandshakeSocket
from exporter.client.enginecore.links import (
    DRAIN_BATCH,
    NOBLOCK,
    SNDMORE_NOBLOCK,
    EngineLink,
    FleetShape,
    Phase,
    port_of,
    recv_message_peer,
    send_frame,
)
from exporter.client.enginecore.linkstate import CALLABLE
from exporter.client.enginecore.output import OutputReader
from exporter.client.enginecore.state_check import StateExpectation
from exporter.client.enginecore.state_file import (
    StateFile,
    StateSnapshot,
    records_of,
    unknown_since_restart,
)
from exporter.error import EngineUnavailable, ProtocolError
from exporter.protocol import UTILITY_REQUEST_TYPE, RegistrationInfo, decode_registration
from exporter.protocol.activity import RequestCounts
from exporter.protocol.kv_events import KIND as KV_EVENTS_KIND
from exporter.protocol.kv_events import with_engine_host
from exporter.protocol.pushes import FaultStatus

log = logging.getLogger("exporter.transport")


class EngineDataPlane(OutputReader):
    """Input and output sockets of every expected engine.

    Each attach mode implements the abstract hooks: it runs the handshake (``_start_control`` /
    ``_on_handshake_frames``), says which engines it cannot serve (``_refusal``) and what its
    state file records (``_state_extra``), and moves links through ``Phase``. This class binds
    the sockets, routes utility frames and reads registrations; ``OutputReader`` handles
    outputs, deaths and (re)connections.
    """

    #: ZMQ sockets and file descriptors per engine at their peak (every engine handshaking at
    #: once); a mode with more per-engine sockets (the relay's upstream) raises them.
    #: The output PULL and its monitor are shared by every engine: ``SOCKETS_BASE``.
    SOCKETS_PER_ENGINE = sockets.SOCKETS_PER_ENGINE
    FDS_PER_ENGINE = sockets.FDS_PER_ENGINE
    #: The exporter's slot on every engine when the mode fixes it (owner: 0); a state file
    #: naming any other is not believed.
    FIXED_SLOT: int | None = None
    #: What ignoring a state file means in this mode (the end of its warning).
    IGNORED_STATE = "its engines are not restored"

    def __init__(
        self,
        shape: FleetShape,
        listener: TransportListener,
        faults: ProtocolErrorTally,
        *,
        context: zmq.asyncio.Context | None = None,
        state_writes: Counter[str] | None = None,
    ) -> None:
        super().__init__(shape, listener, faults)
        self._own_context = context is None
        self._ctx = context or zmq.asyncio.Context()
        self._input: zmq.Socket[bytes] | None = None
        self._readers: list[int] = []
        self._input_check_scheduled = False
        self._handshake_side = HandshakeSocket(self._ctx, faults, self._on_handshake_frames)
        self.input_address = ""
        #: State-file writes by outcome (``vllm_dp_state_file_writes_total``).
        self.state_writes: Counter[str] = state_writes if state_writes is not None else Counter()
        self._state = StateFile(shape.state_file, self._state_snapshot, faults, self.state_writes)
        #: Identities outside the expected set that tried to handshake (listed in /status).
        self.unexpected = UnexpectedEngines()

    def counters(self) -> dict[str, Counter[str]]:
        """The series this transport keeps of its own (family → label value → count)."""
        return {"vllm_dp_state_file_writes_total": self.state_writes}

    def request_counts(self) -> Mapping[int, RequestCounts]:
        """Engine index → its running and waiting requests, where this mode learns them (the
        relay, from the DP coordinator); none here."""
        return {}

    # -- lifecycle -------------------------------------------------------------------------

    def check_resources(self) -> None:
        """Raise the context's socket limit and the process's open-file limit to what this
        many engines need; ConfigError (one line) when the machine's limits are too low.
        libzmq reads the socket limit when a context opens its first socket: a context passed
        in must be sized by its owner (``sockets.raise_max_sockets``)."""
        count = self.shape.engine_count
        sockets.raise_max_sockets(
            self._ctx, sockets.sockets_needed(count, per_engine=self.SOCKETS_PER_ENGINE)
        )
        sockets.ensure_open_files(sockets.descriptors_needed(count, per_engine=self.FDS_PER_ENGINE))

    async def start(self) -> None:
        """Bind every socket and start receiving; engines may connect from now on."""
        self.check_resources()
        self._state.lock()  # before any bind: a second exporter on the file leaves no trace
        self._loop = asyncio.get_running_loop()
        shape = self.shape
        base = shape.fixed_base_port
        bind_host = shape.bind_host or shape.advertise_host
        try:
            self._input = sockets.plain_socket(self._ctx, zmq.ROUTER)
            self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._input.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self.input_address = await sockets.bind_when_free(
                partial(sockets.bind, self._input, bind_host, shape.advertise_host, base)
            )
            self._output = output = sockets.plain_socket(self._ctx, zmq.PULL)
            for offset, link in enumerate(self._links.values()):
                port = None if base is None else base + 1 + offset
                link.output_address = await sockets.bind_when_free(
                    partial(sockets.bind, output, bind_host, shape.advertise_host, port)
                )
                self._by_port[port_of(link.output_address)] = link
            self._output_monitor = sockets.monitor_socket(self._ctx, output, f"{id(self)}")
            await self._start_control()
        except BaseException:
            await self.close()
            raise
        assert self._output is not None and self._output_monitor is not None
        self._watch(self._input, self._drain_input)
        self._watch(self._output_monitor, self._drain_monitor)
        self._watch(self._output, self._drain_output, True)

    def _watch(self, sock: zmq.Socket[bytes], drain: Callable[..., None], *args: object) -> None:
        """Call ``drain(*args)`` whenever the socket's (edge-triggered) FD signals, and once
        now (a bound method with arguments: no closure frame per wake-up on the hot path)."""
        assert self._loop is not None
        fd = cast(int, sock.getsockopt(zmq.FD))
        self._loop.add_reader(fd, drain, *args)
        self._readers.append(fd)
        self._loop.call_soon(drain, *args)

    async def close(self) -> None:
        """Stop receiving and close every socket with linger 0."""
        await self._close_control()
        await self._state.close()
        if self._loop is not None:
            for fd in self._readers:
                self._loop.remove_reader(fd)
        self._readers.clear()
        if self._output is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._output.disable_monitor()
        for sock in (self._output_monitor, self._output):
            if sock is not None:
                sock.close(linger=0)
        self._output = self._output_monitor = None
        if self._input is not None:
            self._input.close(linger=0)
            self._input = None
        if self._own_context:
            # A relay's upstream socket closed after READY may still be flushing it.
            await asyncio.to_thread(self._ctx.term)

    @abc.abstractmethod
    async def _start_control(self) -> None:
        """Start the mode's handshake side (``_open_handshake``) once the data plane is bound."""

    async def _close_control(self) -> None:
        """Stop the handshake side."""
        await self._close_handshake()

    # -- the handshake socket ------------------------------------------------------------------

    async def _open_handshake(self, address: str) -> None:
        """Bind the handshake ROUTER the engines dial (``HandshakeSocket``)."""
        await sockets.bind_when_free(partial(self._handshake_side.open, address))

    async def _close_handshake(self) -> None:
        await self._handshake_side.close()

    @property
    def _handshake(self) -> zmq.asyncio.Socket | None:
        return self._handshake_side.sock

    @abc.abstractmethod
    async def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        """One message on the handshake ROUTER: the mode's handshake."""

    @abc.abstractmethod
    def _refusal(self, link: EngineLink) -> str | None:
        """Why this attach mode cannot serve a handshaken engine (None: it can)."""

    def _new_process(self, link: EngineLink) -> None:
        """A new engine process began its handshake (its HELLO): it starts healthy. What an
        earlier process pushed is forgotten here, not once the engine is up: a push it makes
        as soon as its sockets connect can be read before its READY is, and is its own."""
        link.fault_status = None
        self._listener.on_engine_hello(link.engine_index)

    def _maybe_up(self, link: EngineLink) -> None:
        """READY and the registration travel on different connections: up when both came."""
        if link.phase is not Phase.INIT_SENT or not (link.ready and link.registered):
            return
        reason = self._refusal(link)
        if reason is not None:
            link.refused = reason
            self._set_phase(link, Phase.REFUSED)
            self._faults.record("engine_refused", f"engine {link.engine_index}: {reason}")
            log.error("engine %d refused: %s", link.engine_index, reason)
            return
        link.refused = None
        self._set_phase(link, Phase.UP)
        log.info("engine %d connected (client_index %s)", link.engine_index, link.slot)
        self._write_state()
        self._listener.on_engine_up(link.engine_index, handshaken=True)

    # -- the state file ----------------------------------------------------------------------

    @abc.abstractmethod
    def _state_extra(self) -> dict[str, str]:
        """Addresses the state file records beside the engines (for the operator)."""

    def _write_state(self) -> None:
        """Remember every engine with a slot: a restarted exporter on the same fixed addresses
        finds them (and what they registered) again, since they never handshake twice. Written
        in the background, coalesced (``StateWriter``); ``close`` waits for the last write."""
        self._state.request()

    def _state_snapshot(self) -> StateSnapshot:
        extra: dict[str, Any] = {"engine_count": self.shape.engine_count}
        extra.update(start_rank=self.shape.start_rank, **self._state_extra())
        return self.input_address, extra, records_of(self._links.values())

    def _restore_state(self) -> None:
        """Engines a previous exporter process on these addresses had: callable until proven
        otherwise, with their registration details (no handshake will repeat them). Only a
        file whose every field is possible for these engines is believed (``state_check``)."""
        shape, links = self.shape, self._links
        engines = {i: (link.identity.hex(), link.output_address) for i, link in links.items()}
        expect = StateExpectation(
            self.input_address, shape.engine_count, shape.start_rank, engines, self.FIXED_SLOT
        )
        restored = self._state.restore(links, expect, self.IGNORED_STATE)
        for link in links.values():  # reattachable without a record (owner mode's fixed ports)
            if link.phase is Phase.RESTORED and link.engine_index not in restored:
                link.fault_status = unknown_since_restart(bool(self._state.path))
        if restored:
            self._changed.set()

    def keep_fault_status(self, engine_index: int, status: FaultStatus | None) -> None:
        """The engine's fault-tolerance status changed (the client decoded its push): kept in
        the state file, so a restarted exporter does not read the engine as healthy."""
        link = self._links[engine_index]
        if link.fault_status != status:
            link.fault_status = status
            self._write_state()

    def confirm_dead(self, engine_index: int) -> None:
        """The engine is dead (its ENGINE_CORE_DEAD was confirmed): stop calling it."""
        link = self._links[engine_index]
        if link.phase is Phase.DEAD:
            return
        log.warning("engine %d is dead (ENGINE_CORE_DEAD)", engine_index)
        self._set_phase(link, Phase.DEAD)
        self._write_state()
        self._listener.on_engine_down(engine_index, "dead")

    # -- sending ---------------------------------------------------------------------------

    def send_utility(self, engine_index: int, payload: bytes) -> None:
        """Route a UTILITY payload to one engine; EngineUnavailable when it cannot be sent."""
        link = self._links[engine_index]
        if link.slot is None or link.phase not in CALLABLE:
            raise EngineUnavailable(f"engine {engine_index} is {self._why_not(link)}")
        assert self._input is not None and self._loop is not None
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
            self._schedule_input_drain()

    def _schedule_input_drain(self) -> None:
        if not self._input_check_scheduled and self._loop is not None:
            self._input_check_scheduled = True
            self._loop.call_soon(self._drain_input)

    # -- receiving -------------------------------------------------------------------------

    def _drain_input(self) -> None:
        self._input_check_scheduled = False
        sock = self._input
        for _ in range(DRAIN_BATCH):
            received = recv_message_peer(sock) if sock is not None else None
            if received is None:
                return
            try:
                self._on_input_frames(*received)
            except ProtocolError as exc:
                self._faults.record(exc.kind, f"input socket: {exc}")
            except Exception as exc:  # a bug must not stop the reader: count it, go on
                self._faults.task_failed("input_reader", exc)
        self._schedule_input_drain()  # more may be queued: continue next turn

    def _on_input_frames(self, frames: list[bytes], peer: str | None = None) -> None:
        """A registration; ``peer`` is the address it came from (the engine's host)."""
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
            registration = decode_registration(payload)
        except ProtocolError as exc:
            registration = RegistrationInfo()
            self._faults.record(exc.kind, f"engine {link.engine_index} registration: {exc}")
        if registration.kv_events_error is not None:
            why = f"engine {link.engine_index} kv_events_config: {registration.kv_events_error}"
            self._faults.record(KV_EVENTS_KIND, why)
        if registration.kv_events is not None:
            kv_events = with_engine_host(registration.kv_events, peer)
            registration = replace(registration, kv_events=kv_events)
        link.registration = registration
        self._maybe_up(link)
