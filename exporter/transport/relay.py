"""Relay mode: the exporter sits in the handshake between headless engines and a stock vLLM
front end and appends its own client slot to each engine's INIT (``engine-core-protocol.md``
F.5). Afterwards the front end and the engines talk directly; the exporter has a private
input/output pair on every engine.

Sockets:

* the relay's handshake ROUTER, bound at ``handshake_address`` for the life of the process (the
  engines dial it instead of the front end; restarted engines handshake again through it);
* per handshake, a DEALER to ``upstream_handshake_address`` with the engine's own identity, so the
  front end cannot tell it from the engine; closed after READY with a non-zero linger;
* one input ROUTER (``ROUTER_MANDATORY``) and one output PULL per engine, as in owner mode, so an
  ENGINE_CORE_DEAD is attributable to one engine.

Per engine and handshake: HELLO up byte for byte exactly once; INIT down with the exporter's
addresses appended (``append_client_slot``; when the INIT cannot be rewritten exactly it goes down
unchanged and the engine is served by the front end alone); READY up byte for byte exactly once.
The engine is callable once READY went up *and* its registration arrived on the input ROUTER.

``vllm_dp_relay_handshakes_total{result}`` (``counter``), one result per handshake attempt:

* ``completed``: READY forwarded, the exporter's slot is in place;
* ``init_rewrite_refused``: the upstream INIT was forwarded unchanged (not a canonical INIT the
  exporter can rewrite byte-exactly); that engine works for the front end, not for the exporter;
* ``upstream_timeout``: no INIT from the front end within ``upstream_timeout_s`` (front end down
  or rejecting the engine); the queued HELLO is dropped, the engine will give up on its own;
* ``superseded``: the engine sent a new HELLO before its previous handshake finished (restart).

State file (``state_file``): after each READY the exporter writes, atomically, its addresses and
each handshaken engine's identity and client_index. A restarted exporter on the same fixed
addresses restores those engines as callable at once (the engines reconnect at the ZMQ level
and never handshake again); an engine counts as connected again once it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from exporter.client import EngineCoreClient
from exporter.config import ServeConfig
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
    engine_identity,
)
from exporter.protocol.relay import append_client_slot
from exporter.stats import Stats
from exporter.transport.events import EngineLinkView, ProtocolErrorTally, TransportListener
from exporter.transport.owner import MAX_FRAME_BYTES, EngineUnavailable

log = logging.getLogger("exporter.transport.relay")

STATE_VERSION = 1
#: Linger of the upstream DEALER after READY: the engine's own handshake DEALER uses 5000 ms.
UPSTREAM_LINGER_MS = 5000
#: An engine waits 5 minutes for INIT (``HANDSHAKE_TIMEOUT_MINS``); give up a little later.
UPSTREAM_TIMEOUT_S = 310.0


class Phase(enum.Enum):
    IDLE = "idle"  # no handshake seen
    HELLO_SENT = "hello_sent"  # HELLO forwarded upstream, waiting for the front end's INIT
    INIT_SENT = "init_sent"  # INIT forwarded to the engine, waiting for READY and registration
    UP = "up"  # READY forwarded and registration received (or unslotted: READY forwarded)
    RESTORED = "restored"  # from the state file: callable, connected once it answers
    DEAD = "dead"  # ENGINE_CORE_DEAD received; a new HELLO revives it


@dataclass
class RelayConfig:
    """Addresses and fleet shape for relay mode."""

    handshake_address: str
    upstream_handshake_address: str
    engine_count: int
    start_rank: int = 0
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    #: Input ROUTER at ``fixed_base_port``, engine offset i's PULL at base+1+i (restart reattach).
    fixed_base_port: int | None = None
    state_file: str | None = None
    upstream_timeout_s: float = UPSTREAM_TIMEOUT_S
    upstream_linger_ms: int = UPSTREAM_LINGER_MS

    def __post_init__(self) -> None:
        if self.engine_count < 1:
            raise ValueError("engine_count must be at least 1")
        if self.start_rank < 0 or self.start_rank + self.engine_count > 0x10000:
            raise ValueError("engine ranks must fit in 0..65535")
        if self.upstream_linger_ms <= 0:
            raise ValueError("upstream_linger_ms must be positive (linger 0 can drop READY)")

    @property
    def engine_indices(self) -> range:
        return range(self.start_rank, self.start_rank + self.engine_count)


@dataclass
class _Link:
    engine_index: int
    identity: bytes
    output_address: str = ""
    phase: Phase = Phase.IDLE
    #: The exporter's client_index on this engine; None when the INIT was not rewritten.
    slot: int | None = None
    ready: bool = False
    registered: bool = False
    handshakes: int = 0
    attempt: int = 0
    registration: RegistrationInfo | None = None
    upstream: zmq.asyncio.Socket | None = field(default=None, repr=False)
    upstream_task: asyncio.Task[None] | None = field(default=None, repr=False)
    #: The last INIT as the front end sent it and as the engine got it (for checks and status).
    init_upstream: bytes | None = field(default=None, repr=False)
    init_forwarded: bytes | None = field(default=None, repr=False)
    pull: zmq.asyncio.Socket | None = field(default=None, repr=False)


class RelayTransport:
    """Relays every expected engine's handshake, then routes the exporter's own frames."""

    def __init__(
        self,
        config: RelayConfig,
        listener: TransportListener,
        errors: ProtocolErrorTally,
        handshakes: Counter[str] | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.config = config
        self._listener = listener
        self._errors = errors
        self.handshake_results: Counter[str] = handshakes if handshakes is not None else Counter()
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
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sockets.append(sock)
        return sock

    def _bind(self, sock: zmq.asyncio.Socket, port: int | None) -> str:
        host = self.config.bind_host or self.config.advertise_host
        sock.bind(f"tcp://{host}:{port if port is not None else '*'}")
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        bound_port = bound.rsplit(":", 1)[1]
        return f"tcp://{self.config.advertise_host}:{bound_port}"

    async def start(self) -> None:
        """Bind every socket, restore engines from the state file, start the loops."""
        base = self.config.fixed_base_port
        self._input = self._socket(zmq.ROUTER)
        self._input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.input_address = self._bind(self._input, base)
        for offset, link in enumerate(self._links.values()):
            link.pull = self._socket(zmq.PULL)
            link.output_address = self._bind(link.pull, None if base is None else base + 1 + offset)
        self._restore_state()
        self._handshake = self._socket(zmq.ROUTER)
        self._handshake.bind(self.config.handshake_address)
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._handshake_loop(self._handshake)))
        self._tasks.append(loop.create_task(self._input_loop(self._input)))
        for link in self._links.values():
            assert link.pull is not None
            self._tasks.append(loop.create_task(self._output_loop(link, link.pull)))
        log.info(
            "relay: engines dial %s, front end at %s, exporter input %s",
            self.config.handshake_address,
            self.config.upstream_handshake_address,
            self.input_address,
        )

    async def close(self) -> None:
        """Stop the loops and close every socket (an upstream mid-handshake with linger 0)."""
        self._closed = True
        tasks = list(self._tasks)
        for link in self._links.values():
            if link.upstream_task is not None:
                tasks.append(link.upstream_task)
                link.upstream_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        for link in self._links.values():
            self._drop_upstream(link)
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()
        if self._own_context:
            # An upstream DEALER closed after READY may still be flushing it (bounded by linger).
            await asyncio.to_thread(self._ctx.term)

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
        """The exporter's slot on this engine, as computed from the INIT it relayed."""
        slot = self._links[engine_index].slot
        if slot is None:
            raise EngineUnavailable(f"engine {engine_index} has no exporter slot")
        return slot

    def connected_count(self) -> int:
        return sum(1 for view in self.link_views() if view.connected)

    def phase(self, engine_index: int) -> Phase:
        return self._links[engine_index].phase

    def init_frames(self, engine_index: int) -> tuple[bytes | None, bytes | None]:
        """The last INIT as received from the front end and as forwarded to the engine."""
        link = self._links[engine_index]
        return link.init_upstream, link.init_forwarded

    async def wait_connected(self, timeout_s: float, indices: Iterable[int] | None = None) -> None:
        """Wait until every (given) engine is callable; HandshakeError on timeout."""
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
                    f"engines {missing} did not complete the relayed handshake within "
                    f"{timeout_s:g}s"
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
            self._input.send_multipart(
                [link.identity, UTILITY_REQUEST_TYPE, payload], flags=zmq.NOBLOCK, copy=True
            )
        except zmq.ZMQError as exc:
            raise EngineUnavailable(f"engine {engine_index} is not routable: {exc}") from None

    # -- state -----------------------------------------------------------------------------

    def _set_phase(self, link: _Link, phase: Phase) -> None:
        link.phase = phase
        self._changed.set()

    def _state(self) -> dict[str, Any]:
        engines = [
            {
                "engine_index": link.engine_index,
                "identity": link.identity.hex(),
                "client_index": link.slot,
                "output_address": link.output_address,
            }
            for link in self._links.values()
            if link.slot is not None
            and link.phase in (Phase.UP, Phase.RESTORED, Phase.INIT_SENT)
            and (link.ready or link.phase is Phase.RESTORED)
        ]
        return {
            "version": STATE_VERSION,
            "input_address": self.input_address,
            "handshake_address": self.config.handshake_address,
            "upstream_handshake_address": self.config.upstream_handshake_address,
            "engines": engines,
        }

    def _write_state(self) -> None:
        path = self.config.state_file
        if not path:
            return
        target = Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".relay-state-", dir=target.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(self._state(), f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            log.error("relay: cannot write state file %s: %s", path, exc)

    def _restore_state(self) -> None:
        path = self.config.state_file
        if not path or not Path(path).exists():
            return
        try:
            state = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            log.warning("relay: ignoring unreadable state file %s: %s", path, exc)
            return
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            log.warning("relay: ignoring state file %s of an unknown version", path)
            return
        if state.get("input_address") != self.input_address:
            log.warning(
                "relay: state file %s was written for input %s, now %s: engines cannot "
                "reconnect (use --fixed-base-port); ignoring it",
                path,
                state.get("input_address"),
                self.input_address,
            )
            return
        restored = []
        for entry in state.get("engines") or []:
            if not isinstance(entry, dict):
                continue
            link = self._links.get(entry.get("engine_index", -1))
            slot = entry.get("client_index")
            if (
                link is None
                or entry.get("identity") != link.identity.hex()
                or entry.get("output_address") != link.output_address
                or not isinstance(slot, int)
                or isinstance(slot, bool)
                or slot < 0
            ):
                log.warning("relay: state file entry %r does not match this exporter", entry)
                continue
            link.slot = slot
            link.phase = Phase.RESTORED
            restored.append(link.engine_index)
        if restored:
            log.info("relay: restored engines %s from %s without a handshake", restored, path)
            self._changed.set()

    # -- handshake relay -------------------------------------------------------------------

    async def _handshake_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._on_engine_handshake(sock, frames)
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"relay handshake socket: {exc}")

    async def _on_engine_handshake(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ProtocolError("wrong_frame_count", f"{len(frames)} frames on handshake socket")
        identity, payload = frames
        link = self._by_identity.get(identity)
        if link is None:
            raise ProtocolError("unknown_identity", f"handshake from identity {identity.hex()}")
        message = decode_handshake_message(payload)
        if message.status == HELLO:
            await self._relay_hello(link, payload)
        elif message.status == READY:
            await self._relay_ready(link, payload)
        else:
            raise ProtocolError(
                "unexpected_status", f"engine {link.engine_index} sent status {message.status!r}"
            )

    def _drop_upstream(self, link: _Link, linger_ms: int = 0) -> None:
        task, link.upstream_task = link.upstream_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        sock, link.upstream = link.upstream, None
        if sock is not None:
            sock.close(linger=linger_ms)

    async def _relay_hello(self, link: _Link, payload: bytes) -> None:
        if link.phase in (Phase.HELLO_SENT, Phase.INIT_SENT):
            # A new HELLO means a new engine process (a real engine sends exactly one); the old
            # handshake is abandoned. Linger 0 drops a HELLO still queued for the front end.
            self.handshake_results["superseded"] += 1
            log.warning(
                "engine %d sent a new HELLO mid-handshake: relaying afresh", link.engine_index
            )
        if link.phase in (Phase.UP, Phase.RESTORED, Phase.DEAD) or link.handshakes:
            log.warning("engine %d restarted: relaying its handshake again", link.engine_index)
            self._listener.on_engine_down(link.engine_index, "restarted")
        self._drop_upstream(link)
        link.slot = None
        link.ready = link.registered = False
        link.registration = None
        link.init_upstream = link.init_forwarded = None
        link.handshakes += 1
        link.attempt += 1
        upstream = self._ctx.socket(zmq.DEALER)
        upstream.setsockopt(zmq.IDENTITY, link.identity)
        upstream.setsockopt(zmq.LINGER, self.config.upstream_linger_ms)
        upstream.setsockopt(zmq.RCVHWM, 0)
        upstream.setsockopt(zmq.SNDHWM, 0)
        upstream.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # Connect-side queueing: HELLO waits in the pipe until the front end listens.
        upstream.connect(self.config.upstream_handshake_address)
        link.upstream = upstream
        self._set_phase(link, Phase.HELLO_SENT)
        self._write_state()
        await upstream.send(payload)
        link.upstream_task = asyncio.get_running_loop().create_task(
            self._upstream_loop(link, upstream, link.attempt)
        )
        log.info("engine %d: HELLO relayed to the front end", link.engine_index)

    async def _upstream_loop(self, link: _Link, sock: zmq.asyncio.Socket, attempt: int) -> None:
        try:
            if not await sock.poll(self.config.upstream_timeout_s * 1000):
                if link.attempt == attempt and link.phase is Phase.HELLO_SENT:
                    self.handshake_results["upstream_timeout"] += 1
                    log.error(
                        "engine %d: no INIT from the front end at %s within %gs",
                        link.engine_index,
                        self.config.upstream_handshake_address,
                        self.config.upstream_timeout_s,
                    )
                    self._drop_upstream(link)
                    self._set_phase(link, Phase.IDLE)
                return
            frames = await sock.recv_multipart()
            if link.attempt != attempt:
                return
            self._forward_init(link, frames)
            while True:
                frames = await sock.recv_multipart()
                self._errors.record(
                    "unexpected_upstream_message",
                    f"front end sent engine {link.engine_index} another {len(frames)}-frame "
                    "message after INIT; dropped",
                )
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if not self._closed:
                log.warning("engine %d: upstream socket error: %s", link.engine_index, exc)

    def _forward_init(self, link: _Link, frames: list[bytes]) -> None:
        assert self._handshake is not None
        forwarded = frames
        if len(frames) == 1:
            link.init_upstream = frames[0]
            try:
                new_init, slot = append_client_slot(
                    frames[0], self.input_address, link.output_address
                )
            except ProtocolError as exc:
                self._errors.record(exc.kind, f"engine {link.engine_index} INIT: {exc}")
            else:
                link.slot = slot
                forwarded = [new_init]
        else:
            self._errors.record(
                "wrong_frame_count", f"front end INIT for engine {link.engine_index}: {len(frames)}"
            )
        if link.slot is None:
            self.handshake_results["init_rewrite_refused"] += 1
            log.error(
                "engine %d: INIT forwarded unchanged, the exporter has no slot on it",
                link.engine_index,
            )
        link.init_forwarded = forwarded[0] if len(forwarded) == 1 else None
        self._handshake.send_multipart([link.identity, *forwarded], flags=zmq.NOBLOCK)
        self._set_phase(link, Phase.INIT_SENT)
        log.info("engine %d: INIT relayed (exporter client_index %s)", link.engine_index, link.slot)

    async def _relay_ready(self, link: _Link, payload: bytes) -> None:
        if link.phase is not Phase.INIT_SENT or link.ready or link.upstream is None:
            raise ProtocolError(
                "unexpected_ready", f"engine {link.engine_index} sent READY out of order"
            )
        await link.upstream.send(payload)
        link.ready = True
        # Non-zero linger: the socket stays until READY is delivered (linger 0 can drop it).
        self._drop_upstream(link, self.config.upstream_linger_ms)
        if link.slot is not None:
            self.handshake_results["completed"] += 1
            self._write_state()
        else:
            # Served by the front end only: nothing more for the exporter to wait for.
            self._set_phase(link, Phase.UP)
        log.info("engine %d: READY relayed", link.engine_index)
        self._maybe_up(link)

    # -- receive loops ---------------------------------------------------------------------

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

    def _maybe_up(self, link: _Link) -> None:
        if link.phase is Phase.INIT_SENT and link.ready and link.registered:
            self._set_phase(link, Phase.UP)
            log.info("engine %d connected (client_index %s)", link.engine_index, link.slot)

    async def _output_loop(self, link: _Link, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            if frames[0] == ENGINE_CORE_DEAD:
                log.warning("engine %d sent ENGINE_CORE_DEAD", link.engine_index)
                self._set_phase(link, Phase.DEAD)
                self._write_state()
                self._listener.on_engine_down(link.engine_index, "dead")
                continue
            if len(frames) > 1:
                self._errors.record(
                    "extra_frames", f"engine {link.engine_index}: {len(frames)} output frames"
                )
            try:
                output = decode_engine_outputs(frames[0])
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
            if link.phase is Phase.RESTORED:
                self._set_phase(link, Phase.UP)
                log.info("engine %d answers again after the exporter restart", link.engine_index)
            self._listener.on_output(link.engine_index, output)


def relay_config(config: ServeConfig) -> RelayConfig:
    if not config.upstream_handshake_address:
        raise ValueError("relay mode needs upstream_handshake_address")
    return RelayConfig(
        handshake_address=config.handshake_address,
        upstream_handshake_address=config.upstream_handshake_address,
        engine_count=config.engine_count,
        start_rank=config.start_rank,
        advertise_host=config.advertise_host,
        bind_host=config.bind_host,
        fixed_base_port=config.fixed_base_port,
        state_file=config.state_file,
    )


def make_relay_client(
    config: ServeConfig, errors: ProtocolErrorTally, stats: Stats
) -> EngineCoreClient:
    """The relay-mode ``FleetClient``: an ``EngineCoreClient`` over a ``RelayTransport``.

    ``stats.relay_handshakes`` (a ``Counter[str]``) receives one result per handshake attempt.
    """
    client = EngineCoreClient(errors)
    client.attach(RelayTransport(relay_config(config), client, errors, stats.relay_handshakes))
    return client
