"""Relay mode's request counts: a subscription to the DP coordinator's publication.

vLLM's DP coordinator publishes every engine's ``[waiting, running, ...]`` to its front ends
(``frontend_stats_publish_address``, in the INIT the relay forwards; docs/protocol.md socket 6)
every 100 ms while they change and every 5 s otherwise: what the stock front end routes by. The
relay subscribes as one more front end does (a SUB socket: its only message is the subscription
``b"\\x01"``, which the coordinator ignores; it never sends anything else), keeps the last
counts, and forgets them when no publication came for ``STALE_AFTER_S`` (a coordinator gone
quiet is unknown, never idle); it then subscribes afresh (a publication over the size bound
makes ZMQ drop the connection for good). Only in-range ranks of the fleet are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore import sockets
from exporter.error import ProtocolError
from exporter.protocol.activity import (
    MAX_COORDINATOR_MESSAGE,
    RequestCounts,
    decode_coordinator_stats,
)

log = logging.getLogger("exporter.relay")

#: Counts older than this are unknown (the coordinator publishes at least every 5 s).
STALE_AFTER_S = 15.0


class CoordinatorCounts:
    """The last counts the DP coordinator published, per engine index."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        faults: ProtocolErrorTally,
        engine_indices: range,
    ) -> None:
        self._context = context
        self._faults = faults
        self._indices = engine_indices
        self._clock = time.monotonic
        self.address: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._counts: dict[int, RequestCounts] = {}
        self._received_at: float | None = None
        self.publications = 0

    def follow(self, address: str | None) -> None:
        """Subscribe to ``address`` (from a forwarded INIT); a new address replaces the old."""
        if not address or address == self.address:
            return
        self._stop()
        self.address = address
        self._task = asyncio.ensure_future(self._follow(address))
        log.info("relay: request counts from the DP coordinator at %s", address)

    def _subscribe(self, address: str) -> zmq.asyncio.Socket | None:
        sock = sockets.async_socket(self._context, zmq.SUB)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_COORDINATOR_MESSAGE)
        sock.setsockopt(zmq.RCVHWM, 4)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            self._faults.record("bad_coordinator_address", f"{address!r}: {exc}")
            return None
        return sock

    async def _follow(self, address: str) -> None:
        """Read publications; none for ``STALE_AFTER_S``: subscribe afresh. Only this task
        touches the socket (closed in its ``finally``, however the task ends)."""
        while True:
            sock = self._subscribe(address)
            if sock is None:
                return
            try:
                while await sock.poll(timeout=int(STALE_AFTER_S * 1000)):
                    self._take(await sock.recv(flags=zmq.NOBLOCK))
                log.debug("relay: no publication of the DP coordinator: subscribing again")
            except zmq.ZMQError as exc:  # the context is terminating: nothing more to read
                log.debug("relay: coordinator subscription ended: %s", exc)
                return
            finally:
                sock.close(linger=0)

    def counts(self) -> dict[int, RequestCounts]:
        """Engine index → its counts; empty while none are known or they went stale."""
        at = self._received_at
        if at is None or self._clock() - at > STALE_AFTER_S:
            return {}
        return self._counts

    def _take(self, payload: bytes) -> None:
        try:
            ranks = decode_coordinator_stats(payload)
        except ProtocolError as exc:
            self._faults.record(exc.kind, f"DP coordinator publication: {exc}")
            return
        self.publications += 1
        if ranks is None:
            return
        self._counts = {
            index: counts
            for index, counts in enumerate(ranks)
            if counts is not None and index in self._indices
        }
        self._received_at = self._clock()

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._counts, self._received_at = {}, None

    async def close(self) -> None:
        task = self._task
        self._stop()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task
