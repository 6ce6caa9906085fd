"""Every rank's load and routable state on ZMQ PUB sockets, as SGLang's load publisher sends
them (the wire: ``exporter.feed.loadstat``).

Rank ``r`` gets its own PUB socket bound at ``BASE + r`` the first time a snapshot names it (a
router keys what it reads by the socket it came on). After every poll the poller hands
:meth:`LoadPublisher.publish` the snapshot: a value that changed since the last send on that
socket goes out at once; :meth:`LoadPublisher.run` re-sends an unchanged one every ``resend_s``
(the heartbeat SGLang's routers expect from a live rank). A rank that left the fleet stops its
load heartbeat (a stale gauge is worse than silence) and says ``gone`` on ``rank_state``.

The sockets are plain synchronous ZMQ sockets, used from the event loop's thread only: a send
just hands the frames to ZMQ's I/O thread. The send high-water mark is 8 and LINGER 0, so a
subscriber that reads slowly loses old readings (the next heartbeat supersedes them) and
nothing ever waits for it; sends are ``NOBLOCK``, and one that fails is counted, never raised.
A PUB socket sheds what a full subscriber queue cannot take without telling the sender: what a
slow subscriber lost is not counted here (it sees the gap in ``seq``). A port that cannot be bound
(taken, not permitted, past 65535) is logged once, shown in :meth:`LoadPublisher.status_json`
and counted; the other ranks publish on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from exporter.client.enginecore.links import tcp_host
from exporter.feed.loadstat import (
    LOAD_TOPIC,
    RANK_STATE_TOPIC,
    TOPICS,
    LoadStat,
    RankState,
    encode_frames,
    gone_state,
    load_of,
    port_of,
    rank_of,
    rank_state_key,
    rank_state_of,
)
from exporter.fleetstate.snapshot import FleetSnapshot

log = logging.getLogger("exporter.feed")

#: SGLang's ``LOAD_PUB_HWM``: a gauge's old readings are worth dropping, never waiting for.
SEND_HWM = 8
#: How many heartbeat checks per ``resend_s`` (a re-send is at most this fraction late).
CHECKS_PER_RESEND = 4
NOTE = (
    "Rank r publishes on BASE + r in SGLang's load-publisher framing ([topic, seq, payload]; "
    "topics 'load': LoadStat and 'rank_state': RankState); num_tokens is always 0 (the "
    "exporter does not keep KV usage); no load while a rank's request counts are unknown (owner "
    "mode, before the first count); engines whose label is not a rank are not published."
)


@dataclass(slots=True)
class _Topic:
    """One topic on one socket: its next sequence number and its last value."""

    seq: int = 0
    #: The value to send now and on every heartbeat (None: nothing to send).
    latest: LoadStat | RankState | None = None
    #: What the last value sent was (``None``: none sent yet).
    sent_key: Hashable = None
    sent_at: float = float("-inf")


@dataclass(slots=True)
class _Endpoint:
    engine: str
    rank: int
    endpoint: str
    socket: zmq.Socket[bytes] | None = None
    error: str | None = None
    sent: int = 0
    send_failing: bool = False
    topics: dict[bytes, _Topic] = field(default_factory=lambda: {t: _Topic() for t in TOPICS})


class LoadPublisher:
    """One PUB socket per rank at ``host:base_port + rank`` (see the module docstring)."""

    def __init__(
        self,
        host: str,
        base_port: int,
        context: zmq.Context[Any] | None = None,
        resend_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < base_port <= 65535:
            raise ValueError(f"load publisher base port {base_port} is not a TCP port")
        if not resend_s > 0:
            raise ValueError(f"load publisher resend interval {resend_s} is not positive")
        self.host = host
        self.base_port = base_port
        self.resend_s = resend_s
        self._clock = clock
        self._context = context
        self._own_context = context is None
        self._endpoints: dict[int, _Endpoint] = {}
        self._messages = dict.fromkeys(TOPICS, 0)
        self._send_failures = dict.fromkeys(TOPICS, 0)
        self._bind_failures = 0
        self._closed = False

    def _address(self, port: int) -> str:
        return f"tcp://{tcp_host(self.host)}:{port}"

    def publish(self, snap: FleetSnapshot) -> None:
        """Send every rank's load and state that changed since its socket's last send (or is
        due for its heartbeat); bind a rank's socket the first time it appears. Never raises
        for a socket's sake."""
        if self._closed:
            return
        now = self._clock()
        present: set[int] = set()
        for e in snap.engines:
            rank = rank_of(e.engine)
            if rank is None or rank in present:
                continue
            present.add(rank)
            ep = self._endpoints.get(rank) or self._open(e.engine, rank)
            if ep.socket is None:
                continue
            # Unknown counts are no load: silence, so a router falls back to its own count
            # (a 0 would read as an idle rank).
            known = e.requests is not None
            ep.topics[LOAD_TOPIC].latest = load_of(e, rank).stat() if known else None
            ep.topics[RANK_STATE_TOPIC].latest = rank_state_of(e)
            self._flush(ep, now)
        for rank, ep in self._endpoints.items():
            if rank not in present and ep.socket is not None:
                ep.topics[LOAD_TOPIC].latest = None
                ep.topics[RANK_STATE_TOPIC].latest = gone_state(ep.engine)
                self._flush(ep, now)

    def heartbeat(self) -> None:
        """Re-send every value whose last send is ``resend_s`` old (what :meth:`run` does)."""
        if self._closed:
            return
        now = self._clock()
        for ep in self._endpoints.values():
            if ep.socket is not None:
                self._flush(ep, now)

    async def run(self) -> None:
        """The heartbeat, until :meth:`close`: checks every ``resend_s / 4``."""
        while not self._closed:
            await asyncio.sleep(self.resend_s / CHECKS_PER_RESEND)
            self.heartbeat()

    def close(self) -> None:
        """Close every socket (LINGER 0: the ports are free at once) and an own context."""
        self._closed = True
        for ep in self._endpoints.values():
            if ep.socket is not None:
                ep.socket.close(linger=0)
                ep.socket = None
        if self._own_context and self._context is not None:
            self._context.term()
            self._context = None

    def _open(self, engine: str, rank: int) -> _Endpoint:
        port = port_of(self.base_port, rank)
        ep = _Endpoint(engine, rank, self._address(self.base_port + rank))
        self._endpoints[rank] = ep
        if port is None:
            return self._failed(ep, f"port {self.base_port + rank} is past 65535")
        sock: zmq.Socket[bytes] | None = None
        try:
            if self._context is None:
                self._context = zmq.Context()
            sock = self._context.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, SEND_HWM)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            sock.bind(ep.endpoint)
        except zmq.ZMQError as exc:
            if sock is not None:
                sock.close(linger=0)
            return self._failed(ep, f"cannot bind: {exc.strerror}")
        ep.socket = sock
        return ep

    def _failed(self, ep: _Endpoint, error: str) -> _Endpoint:
        ep.error = error
        self._bind_failures += 1
        log.warning("load publisher: rank %s not published on %s: %s", ep.rank, ep.endpoint, error)
        return ep

    def _flush(self, ep: _Endpoint, now: float) -> None:
        for topic, state in ep.topics.items():
            value = state.latest
            if value is None:
                continue
            key = rank_state_key(value) if isinstance(value, RankState) else value
            due = key != state.sent_key or now - state.sent_at >= self.resend_s
            if due and self._send(ep, topic, state, value):
                state.sent_key, state.sent_at = key, now

    def _send(
        self, ep: _Endpoint, topic: bytes, state: _Topic, value: LoadStat | RankState
    ) -> bool:
        """Hand one message to ZMQ; False (counted) when the send fails."""
        sock = ep.socket
        if sock is None:
            return False
        seq, state.seq = state.seq, state.seq + 1  # a refused one leaves a gap a reader sees
        try:
            sock.send_multipart(encode_frames(topic, seq, value), flags=zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            self._send_failures[topic] += 1
            again = isinstance(exc, zmq.Again)  # never raised by PUB today; counted if it is
            if not again and not ep.send_failing:
                log.warning("load publisher: send on %s failed: %s", ep.endpoint, exc)
            ep.send_failing = not again
            return False
        ep.send_failing = False
        ep.sent += 1
        self._messages[topic] += 1
        return True

    def version(self) -> tuple[int, ...]:
        """What a render cache keys on (every counter the series show)."""
        return (
            sum(self._messages.values()),
            sum(self._send_failures.values()),
            self._bind_failures,
        )

    def status_json(self) -> dict[str, Any]:
        """The ``load_publisher`` entry of ``/status``: every rank's endpoint, by rank."""
        endpoints = [
            {
                "engine": ep.engine,
                "endpoint": ep.endpoint,
                "bound": ep.socket is not None,
                "error": ep.error,
                "sent": ep.sent,
            }
            for _, ep in sorted(self._endpoints.items())
        ]
        return {"base": self._address(self.base_port), "endpoints": endpoints, "note": NOTE}

    def figures(self) -> dict[str, dict[tuple[str, ...], float]]:
        """Metric series: messages handed to ZMQ and sends that failed (by topic), bind failures."""
        return {
            "vllm_dp_load_messages_total": {
                (t.decode(),): float(n) for t, n in self._messages.items()
            },
            "vllm_dp_load_send_failures_total": {
                (t.decode(),): float(n) for t, n in self._send_failures.items()
            },
            "vllm_dp_load_bind_failures_total": {(): float(self._bind_failures)},
        }
