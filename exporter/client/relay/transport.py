"""Relay mode: the exporter sits in the handshake between headless engines and a stock vLLM
front end and appends its own client slot to each engine's INIT (``docs/protocol.md``
F.5). Afterwards the front end and the engines talk directly; the exporter has a private
input/output pair on every engine.

Sockets:

* the relay's handshake ROUTER, bound at ``handshake_address`` for the life of the process (the
  engines dial it instead of the front end; restarted engines handshake again through it);
* per handshake, a DEALER to ``upstream_handshake_address`` with the engine's own identity, so the
  front end cannot tell it from the engine; closed after READY with a non-zero linger;
* the data plane shared with owner mode (``exporter.client.enginecore.dataplane``): one input
  ROUTER and one output PULL bound on an address per engine, so an ENGINE_CORE_DEAD is
  attributable to one engine.

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
addresses restores those engines (when every field of the file is possible: ``state_check``)
as callable at once (the engines reconnect at the ZMQ level and never handshake again); an
engine counts as connected again once the socket monitor sees its connection, up once it
answers (``links.is_connected``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.base.tasks import watch
from exporter.client.enginecore import sockets
from exporter.client.enginecore.dataplane import EngineDataPlane
from exporter.client.enginecore.events import TransportListener
from exporter.client.enginecore.links import EngineLink, FleetShape, Phase
from exporter.client.relay.coordinator import CoordinatorCounts
from exporter.error import ProtocolError
from exporter.protocol import (
    HELLO,
    READY,
    RELAY_UPSTREAM_TIMEOUT_S,
    decode_handshake_message,
    decode_init,
    engine_identity,
)
from exporter.protocol.activity import RequestCounts
from exporter.protocol.relay import append_client_slot
from exporter.protocol.utility import MAX_CLIENT_INDEX

log = logging.getLogger("exporter.transport.relay")

#: Linger of the upstream DEALER after READY: the engine's own handshake DEALER uses 5000 ms.
UPSTREAM_LINGER_MS = 5000


@dataclass(kw_only=True)
class RelayConfig(FleetShape):
    """Addresses and fleet shape for relay mode."""

    handshake_address: str
    upstream_handshake_address: str
    upstream_timeout_s: float = RELAY_UPSTREAM_TIMEOUT_S
    upstream_linger_ms: int = UPSTREAM_LINGER_MS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.upstream_linger_ms <= 0:
            raise ValueError("upstream_linger_ms must be positive (linger 0 can drop READY)")


@dataclass
class RelayLink(EngineLink):
    """An engine's link plus the relay's handshake state."""

    attempt: int = 0
    upstream: zmq.asyncio.Socket | None = field(default=None, repr=False)
    upstream_task: asyncio.Task[None] | None = field(default=None, repr=False)
    #: The last INIT as the front end sent it and as the engine got it (for checks and status).
    init_upstream: bytes | None = field(default=None, repr=False)
    init_forwarded: bytes | None = field(default=None, repr=False)


class RelayTransport(EngineDataPlane):
    """Relays every expected engine's handshake, then routes the exporter's own frames."""

    IGNORED_STATE = (
        "the exporter cannot call the engines it lists until they handshake again (the front "
        "end is not affected)"
    )

    #: Plus one upstream DEALER per engine while its handshake is relayed (its socket, its
    #: eventfd and its connection to the front end).
    SOCKETS_PER_ENGINE = EngineDataPlane.SOCKETS_PER_ENGINE + 1
    FDS_PER_ENGINE = EngineDataPlane.FDS_PER_ENGINE + 2

    def __init__(
        self,
        config: RelayConfig,
        listener: TransportListener,
        faults: ProtocolErrorTally,
        handshakes: Counter[str] | None = None,
        *,
        context: zmq.asyncio.Context | None = None,
        state_writes: Counter[str] | None = None,
    ) -> None:
        super().__init__(config, listener, faults, context=context, state_writes=state_writes)
        self.config = config
        first = config.start_rank
        #: The DP coordinator's counts, once a forwarded INIT names its publication.
        self.coordinator = CoordinatorCounts(
            self._ctx, faults, range(first, first + config.engine_count)
        )
        self.handshake_results: Counter[str] = handshakes if handshakes is not None else Counter()
        self._closed = False

    def counters(self) -> dict[str, Counter[str]]:
        return {
            "vllm_dp_relay_handshakes_total": self.handshake_results,
            **super().counters(),
        }

    def request_counts(self) -> Mapping[int, RequestCounts]:
        return self.coordinator.counts()

    def _new_link(self, engine_index: int) -> RelayLink:
        return RelayLink(engine_index, engine_identity(engine_index))

    def _link(self, identity: bytes) -> RelayLink | None:
        link = self._by_identity.get(identity)
        assert link is None or isinstance(link, RelayLink)
        return link

    # -- lifecycle -------------------------------------------------------------------------

    async def _start_control(self) -> None:
        self._restore_state()
        if any(link.phase is Phase.RESTORED for link in self._links.values()):
            # Restored engines never handshake again: no INIT will name the publication.
            self.coordinator.follow(self._state.recorded.get("coordinator_stats_address"))
        await self._open_handshake(self.config.handshake_address)
        log.info(
            "relay: engines dial %s, front end at %s, exporter input %s",
            self.config.handshake_address,
            self.config.upstream_handshake_address,
            self.input_address,
        )

    async def _close_control(self) -> None:
        """Stop relaying; an upstream socket still mid-handshake is closed with linger 0."""
        self._closed = True
        await self.coordinator.close()
        await self._close_handshake()
        tasks = []
        for link in self._links.values():
            assert isinstance(link, RelayLink)
            if link.upstream_task is not None:
                tasks.append(link.upstream_task)
                link.upstream_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for link in self._links.values():
            assert isinstance(link, RelayLink)
            self._drop_upstream(link)

    # -- views -----------------------------------------------------------------------------

    def phase(self, engine_index: int) -> Phase:
        return self._links[engine_index].phase

    def init_frames(self, engine_index: int) -> tuple[bytes | None, bytes | None]:
        """The last INIT as received from the front end and as forwarded to the engine."""
        link = self._links[engine_index]
        assert isinstance(link, RelayLink)
        return link.init_upstream, link.init_forwarded

    # -- state file ------------------------------------------------------------------------

    def _state_extra(self) -> dict[str, str]:
        extra = {
            "handshake_address": self.config.handshake_address,
            "upstream_handshake_address": self.config.upstream_handshake_address,
        }
        if self.coordinator.address is not None:  # counts again after a restart
            extra["coordinator_stats_address"] = self.coordinator.address
        return extra

    # -- handshake relay -------------------------------------------------------------------

    async def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ProtocolError("wrong_frame_count", f"{len(frames)} frames on handshake socket")
        identity, payload = frames
        link = self._link(identity)
        if link is None:
            self.unexpected.record(identity)
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

    def _refusal(self, link: EngineLink) -> str | None:
        """None: relay mode serves every engine the front end accepted, coordinated (MoE) DP
        engines included (the front end's INIT carries the DP group settings they need)."""
        return None

    def _drop_upstream(self, link: RelayLink, linger_ms: int = 0) -> None:
        task, link.upstream_task = link.upstream_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        sock, link.upstream = link.upstream, None
        if sock is not None:
            sock.close(linger=linger_ms)

    async def _relay_hello(self, link: RelayLink, payload: bytes) -> None:
        if link.phase in (Phase.HELLO_SENT, Phase.INIT_SENT):
            # A new HELLO means a new engine process (a real engine sends exactly one); the old
            # handshake is abandoned. Linger 0 drops a HELLO still queued for the front end.
            self.handshake_results["superseded"] += 1
            log.warning(
                "engine %d sent a new HELLO mid-handshake: relaying afresh", link.engine_index
            )
        if link.phase in (Phase.UP, Phase.RESTORED, Phase.LOST, Phase.DEAD) or link.handshakes:
            log.warning("engine %d restarted: relaying its handshake again", link.engine_index)
            self._listener.on_engine_down(link.engine_index, "restarted")
        self._drop_upstream(link)
        link.slot = None
        link.ready = link.registered = False
        link.registration = None
        link.init_upstream = link.init_forwarded = None
        link.handshakes += 1
        link.attempt += 1
        self._new_process(link)
        upstream = sockets.async_socket(
            self._ctx, zmq.DEALER, linger_ms=self.config.upstream_linger_ms
        )
        upstream.setsockopt(zmq.IDENTITY, link.identity)
        # Connect-side queueing: HELLO waits in the pipe until the front end listens.
        upstream.connect(self.config.upstream_handshake_address)
        link.upstream = upstream
        self._set_phase(link, Phase.HELLO_SENT)
        self._write_state()
        await upstream.send(payload)
        link.upstream_task = asyncio.get_running_loop().create_task(
            self._upstream_loop(link, upstream, link.attempt)
        )
        watch(link.upstream_task, "relay_upstream", self._faults)
        log.info("engine %d: HELLO relayed to the front end", link.engine_index)

    async def _upstream_loop(self, link: RelayLink, sock: zmq.asyncio.Socket, attempt: int) -> None:
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
                self._faults.record(
                    "unexpected_upstream_message",
                    f"front end sent engine {link.engine_index} another {len(frames)}-frame "
                    "message after INIT; dropped",
                )
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if not self._closed:
                log.warning("engine %d: upstream socket error: %s", link.engine_index, exc)

    def _forward_init(self, link: RelayLink, frames: list[bytes]) -> None:
        assert self._handshake is not None
        forwarded = frames
        if len(frames) == 1:
            link.init_upstream = frames[0]
            self._follow_coordinator(frames[0])
            try:
                new_init, slot = append_client_slot(
                    frames[0], self.input_address, link.output_address
                )
            except ProtocolError as exc:
                self._faults.record(exc.kind, f"engine {link.engine_index} INIT: {exc}")
            else:
                if slot <= MAX_CLIENT_INDEX:
                    link.slot = slot
                    forwarded = [new_init]
                else:  # a slot the exporter would never send: do not take one
                    self._faults.record(
                        "init_too_many_clients",
                        f"engine {link.engine_index} INIT lists {slot} clients; the exporter's "
                        f"slot would be beyond {MAX_CLIENT_INDEX}",
                    )
        else:
            self._faults.record(
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

    def _follow_coordinator(self, init: bytes) -> None:
        """Subscribe to the counts the DP coordinator publishes to the front end, as named in
        its INIT (the front end's own subscription is untouched)."""
        try:
            address = decode_init(init).addresses.frontend_stats_publish_address
        except ProtocolError:
            return  # counted where the INIT is rewritten
        self.coordinator.follow(address)

    async def _relay_ready(self, link: RelayLink, payload: bytes) -> None:
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
