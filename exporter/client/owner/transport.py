"""Owner mode: the exporter owns the start-up handshake of headless engines, as vLLM's Rust
front end does in ``HandshakeOwner`` mode.

The handshake ROUTER is bound for the life of the process, so restarted engines can handshake
again; the data-plane sockets (input ROUTER, one output PULL on an address per engine) are in
``exporter.client.enginecore.dataplane``. The exporter is the engines' only client: slot 0.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.dataplane import EngineDataPlane
from exporter.client.enginecore.events import TransportListener
from exporter.client.enginecore.links import EngineLink, FleetShape, Phase
from exporter.error import ProtocolError
from exporter.protocol import HELLO, READY, decode_handshake_message, encode_init

log = logging.getLogger("exporter.transport")


@dataclass
class OwnerConfig(FleetShape):
    """Addresses and fleet shape for owner mode."""

    handshake_address: str = field(kw_only=True)


class OwnerTransport(EngineDataPlane):
    """Binds the sockets, runs the handshake for every expected engine, routes frames."""

    #: The exporter is every engine's only client: a state file naming another slot is wrong.
    FIXED_SLOT = 0
    IGNORED_STATE = (
        "the engines reattach on slot 0 without what they registered (vLLM version, sleep mode)"
    )

    def __init__(
        self,
        config: OwnerConfig,
        listener: TransportListener,
        faults: ProtocolErrorTally,
        *,
        context: zmq.asyncio.Context | None = None,
        state_writes: Counter[str] | None = None,
    ) -> None:
        super().__init__(config, listener, faults, context=context, state_writes=state_writes)
        self.config = config

    async def _start_control(self) -> None:
        if self.config.fixed_base_port is not None:
            # Engines that were handshaken by a previous exporter process reconnect on their
            # own to the same addresses; they are callable until proven otherwise.
            for link in self._links.values():
                link.slot = 0
                link.phase = Phase.RESTORED
            self._restore_state()  # their registrations, when a state file remembers them
        await self._open_handshake(self.config.handshake_address)

    async def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) != 2:
            raise ProtocolError("wrong_frame_count", f"{len(frames)} frames on handshake socket")
        identity, payload = frames
        link = self._by_identity.get(identity)
        if link is None:
            self.unexpected.record(identity)
            raise ProtocolError("unknown_identity", f"handshake from identity {identity.hex()}")
        message = decode_handshake_message(payload)
        if message.status == HELLO:
            if message.local or not message.headless:
                raise ProtocolError(
                    "unexpected_hello_flags",
                    f"engine {link.engine_index} HELLO local={message.local} "
                    f"headless={message.headless}; only --headless engines can attach",
                )
            self._answer_hello(sock, link)
        elif message.status == READY:
            if link.phase is not Phase.INIT_SENT or link.ready:
                raise ProtocolError(
                    "unexpected_ready", f"engine {link.engine_index} sent READY out of order"
                )
            link.ready = True
            link.coordinated = "parallel_config_hash" in message.extra
            self._maybe_up(link)
        else:
            raise ProtocolError(
                "unexpected_status", f"engine {link.engine_index} sent status {message.status!r}"
            )

    def _refusal(self, link: EngineLink) -> str | None:
        """Coordinated (MoE) DP engines need the DP group settings a front end sends in INIT
        (``parallel_config``); owner mode sends none and cannot coordinate their waves, so it
        refuses them with a pointer to relay mode (which forwards the front end's INIT)."""
        size = link.registration.data_parallel_size if link.registration else None
        if link.coordinated or (size is not None and size > 1):
            return (
                f"coordinated (MoE) data-parallel engine (data_parallel_size={size}): owner "
                "mode cannot coordinate its DP group; attach with --attach relay beside a vLLM "
                "front end"
            )
        return None

    def _state_extra(self) -> dict[str, str]:
        """Nothing beside the engines: owner mode's file has no front end to name."""
        return {}

    def _answer_hello(self, sock: zmq.asyncio.Socket, link: EngineLink) -> None:
        if link.phase is Phase.INIT_SENT:
            raise ProtocolError(
                "duplicate_hello",
                f"engine {link.engine_index} sent HELLO while its handshake is in progress",
            )
        if link.phase in (Phase.UP, Phase.LOST, Phase.DEAD, Phase.REFUSED) or link.handshakes:
            log.warning("engine %d restarted: handshaking again", link.engine_index)
            self._listener.on_engine_down(link.engine_index, "restarted")
        elif link.phase is Phase.RESTORED:
            # Fixed ports, but this engine starts afresh: it was never ours to reattach.
            self._listener.on_engine_down(link.engine_index, "restarted")
        link.ready = link.registered = link.coordinated = False
        link.registration = None
        link.slot = 0
        link.handshakes += 1
        self._new_process(link)
        init = self._init_for(link)
        sock.send_multipart([link.identity, init], flags=zmq.NOBLOCK)
        self._set_phase(link, Phase.INIT_SENT)
        log.info("engine %d: HELLO answered with INIT", link.engine_index)

    def _init_for(self, link: EngineLink) -> bytes:
        """The INIT ``link``'s engine gets: the exporter's addresses, no coordinator."""
        return encode_init([self.input_address], [link.output_address])
