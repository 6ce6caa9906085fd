"""The admin endpoint's bookkeeping, as pure classes (no I/O, an injectable clock).

* ``AuthThrottle``: failed authentication attempts (admin tokens, basic-auth passwords on either
  listener: ``exporter.web.basicauth``) counted per source address. An address with too many
  recent failures is told to wait (429); other addresses, and correct credentials from
  anywhere, are never affected. The table is bounded: at most ``max_addresses`` entries of at
  most ``limit`` timestamps each; IPv6 clients are grouped by /64 (one host usually owns a
  whole /64).
* ``IdempotencyStore``: answers of completed admin actions by ``Idempotency-Key``, as the IETF
  Idempotency-Key draft describes: a retry with the same key and the same parameters gets the
  stored answer, the same key with other parameters is refused (422), and the same key while its
  first request still runs is refused (409). Only completed actions are stored.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from aiohttp import web

Clock = Callable[[], float]

AUTH_FAILURES_PER_WINDOW = 5
AUTH_WINDOW_S = 60.0
AUTH_MAX_ADDRESSES = 4096
IDEMPOTENCY_TTL_S = 600.0
IDEMPOTENCY_MAX_KEYS = 256


def source_key(remote: str | None) -> str:
    """The throttling key of a client address: IPv4 as is, IPv6 by its /64 (IPv4-mapped IPv6 as
    the IPv4 address), anything else (a UNIX socket, no address) as one shared key."""
    if not remote:
        return "unknown"
    try:
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return "unknown"
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network((addr, 64), strict=False))
    return str(addr)


class AuthThrottle:
    """``limit`` failed attempts within ``window_s`` make one source wait until the oldest of
    them is ``window_s`` old. Never consulted for a correct token (nor for a basic-auth
    credential already verified)."""

    def __init__(
        self,
        limit: int = AUTH_FAILURES_PER_WINDOW,
        window_s: float = AUTH_WINDOW_S,
        max_addresses: int = AUTH_MAX_ADDRESSES,
        clock: Clock = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._clock = clock
        #: source → its recent failure times, least recently failed source first.
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._failures)

    def _expire(self, now: float) -> None:
        """Drop sources whose last failure is older than the window (they sit at the front)."""
        while self._failures:
            source, times = next(iter(self._failures.items()))
            if now - times[-1] < self.window_s:
                break
            del self._failures[source]

    def _recent(self, source: str, now: float) -> deque[float] | None:
        """``source``'s failure times within the window (None when it has none on record)."""
        self._expire(now)
        times = self._failures.get(source)
        while times and now - times[0] >= self.window_s:
            times.popleft()
        return times

    def retry_after(self, source: str) -> float:
        """Seconds until ``source`` may try another token (0 when it may now)."""
        now = self._clock()
        times = self._recent(source, now)
        if times is None or len(times) < self.limit:
            return 0.0
        return max(self.window_s - (now - times[0]), 0.001)

    def remaining(self, source: str) -> int:
        """Failed attempts ``source`` may still make in the window: a caller with slow checks
        (bcrypt) admits no more attempts at once than this, so concurrency cannot beat it."""
        times = self._recent(source, self._clock())
        return self.limit - (len(times) if times is not None else 0)

    def record_failure(self, source: str) -> None:
        now = self._clock()
        times = self._failures.pop(source, None)
        if times is None:
            times = deque(maxlen=self.limit)
        times.append(now)
        self._failures[source] = times  # most recently failed last
        self._expire(now)
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)


@dataclass(frozen=True)
class Replay:
    status: int
    body: dict[str, Any]


Refusal = Literal["mismatch", "in_flight"]


@dataclass
class _Entry:
    fingerprint: Hashable
    expires: float
    answer: Replay | None  # None while the first request runs


class IdempotencyStore:
    """Answers of completed requests by key, for ``ttl_s``; at most ``max_keys`` keys (the
    oldest stored answer is forgotten first). Keys of running requests are never evicted."""

    def __init__(
        self,
        ttl_s: float = IDEMPOTENCY_TTL_S,
        max_keys: int = IDEMPOTENCY_MAX_KEYS,
        clock: Clock = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        for key, entry in list(self._entries.items()):
            if entry.answer is not None and entry.expires < now:
                del self._entries[key]

    def check(self, key: str, fingerprint: Hashable) -> Replay | Refusal | None:
        """The stored answer, a refusal (other parameters, or the first request still runs),
        or None: go ahead (and call ``begin``)."""
        self._expire()
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.fingerprint != fingerprint:
            return "mismatch"
        if entry.answer is None:
            return "in_flight"
        return entry.answer

    def begin(self, key: str, fingerprint: Hashable) -> None:
        """``key``'s request started: same-key requests are refused until ``finish``."""
        self._entries[key] = _Entry(fingerprint, float("inf"), None)

    def finish(self, key: str, answer: Replay | None) -> None:
        """Store ``answer`` for the running request of ``key`` (None: it did not complete;
        forget the key). A no-op once that request was finished."""
        entry = self._entries.get(key)
        if entry is None or entry.answer is not None:
            return
        del self._entries[key]
        if answer is None:
            return
        self._entries[key] = _Entry(entry.fingerprint, self._clock() + self.ttl_s, answer)
        stored = [k for k, e in self._entries.items() if e.answer is not None]
        for old in stored[: max(len(stored) - self.max_keys, 0)]:
            del self._entries[old]


async def read_body_bounded(
    request: web.Request, limit: int, timeout_s: float
) -> bytes | tuple[int, str]:
    """The request body, chunked or not, reading never more than ``limit`` + 1 bytes and for
    at most ``timeout_s``. Returns the body, or the status and error to answer."""
    if request.content_length is not None and request.content_length > limit:
        return 413, "request body too large"
    received = bytearray()

    async def drain() -> bool:
        while True:
            chunk = await request.content.read(limit + 1 - len(received))
            if not chunk:
                return True
            received.extend(chunk)
            if len(received) > limit:
                return False

    try:
        within = await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError:
        return 408, "request body not received in time"
    except (
        ConnectionError,
        aiohttp.ClientPayloadError,
        aiohttp.http_exceptions.HttpProcessingError,
    ):
        return 400, "request body incomplete"
    return bytes(received) if within else (413, "request body too large")
