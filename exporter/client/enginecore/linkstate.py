"""Every expected engine's link and what the layers above may ask of it (no sockets here).

``LinkTable`` is the link-state half of the data plane: which engines exist, their ``Phase``,
whether the exporter may call them (and why not), and waiting for handshakes.
``EngineDataPlane`` adds the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from exporter.client.enginecore.events import LinkSnapshot
from exporter.client.enginecore.links import EngineLink, FleetShape, Phase, is_connected
from exporter.error import EngineUnavailable, HandshakeError
from exporter.protocol import engine_identity
from exporter.protocol.utility import MAX_CLIENT_INDEX

#: Phases in which the exporter may send to an engine.
CALLABLE = (Phase.UP, Phase.RESTORED)


class LinkTable:
    """The links of ``shape``'s engines, by index and by ZMQ identity."""

    def __init__(self, shape: FleetShape) -> None:
        self.shape = shape
        self._links = {idx: self._new_link(idx) for idx in shape.engine_indices}
        self._by_identity = {link.identity: link for link in self._links.values()}
        self._changed = asyncio.Event()

    def _new_link(self, engine_index: int) -> EngineLink:
        """Subclasses with more per-engine state return a subclass of ``EngineLink``."""
        return EngineLink(engine_index, engine_identity(engine_index))

    @property
    def engine_indices(self) -> list[int]:
        return list(self._links)

    def link_snapshots(self) -> list[LinkSnapshot]:
        return [
            LinkSnapshot(
                engine_index=link.engine_index,
                connected=is_connected(link),
                dead=link.phase is Phase.DEAD,
                handshakes=link.handshakes,
                registration=link.registration,
                output_address=link.output_address,
                refused=link.refused,
                fault_status=link.fault_status,
            )
            for link in self._links.values()
        ]

    def is_callable(self, engine_index: int) -> bool:
        link = self._links[engine_index]
        return link.slot is not None and link.phase in CALLABLE

    def client_index(self, engine_index: int) -> int:
        """The exporter's slot on a callable engine; EngineUnavailable otherwise, and for a
        slot no engine can have (never sent: an engine indexes its clients unchecked)."""
        link = self._links[engine_index]
        if link.slot is None or link.phase not in CALLABLE:
            raise EngineUnavailable(f"engine {engine_index} is {self._why_not(link)}")
        slot = link.slot
        if type(slot) is not int or not 0 <= slot <= MAX_CLIENT_INDEX:
            raise EngineUnavailable(
                f"engine {engine_index}: client_index {slot!r} is not a slot an engine can have "
                f"(0..{MAX_CLIENT_INDEX}); not sent"
            )
        return slot

    @staticmethod
    def _why_not(link: EngineLink) -> str:
        if link.phase is Phase.REFUSED:
            return f"refused: {link.refused}"
        if link.phase is Phase.DEAD:
            return "dead (ENGINE_CORE_DEAD)"
        if link.phase is Phase.LOST:
            return "disconnected (its connection closed)"
        return "not connected"

    def connected_count(self) -> int:
        return sum(1 for link in self._links.values() if is_connected(link))

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
