"""The one request path of ``exporter.remote``: an aiohttp session, the TLS context, the
bounded read of every answer, retries within one deadline.

Which calls may be retried is the caller's decision (``Client`` retries reads, and actions that
carry an Idempotency-Key); this module only makes every attempt share the call's deadline, so
``timeout_s`` bounds a call however many attempts it takes. Redirects are never followed: they
would carry the credentials to another address.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from exporter.remote.answers import Answer, printable, read_answer
from exporter.remote.errors import Unreachable


@dataclass(frozen=True)
class Retry:
    """How often a call that is safe to repeat is tried (``attempts``, the first included),
    with a doubling pause starting at ``backoff_s``; all within the call's timeout."""

    attempts: int = 3
    backoff_s: float = 0.25
    max_backoff_s: float = 2.0
    #: Answers a read is retried after (a proxy's 502/504, a restarting exporter's 500).
    statuses: frozenset[int] = frozenset({500, 502, 504})

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError("attempts must be at least 1 and the backoffs not negative")


NO_RETRY = Retry(attempts=1)


class Http:
    """One connection pool, made on first use in the running event loop (so a client can be
    built outside any loop), closed by ``close``; a session given to the constructor is the
    caller's to close."""

    def __init__(
        self,
        tls: ssl.SSLContext | None,
        max_answer_bytes: int,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        #: True: aiohttp's defaults (the system's CAs, the server's name checked).
        self._ssl: ssl.SSLContext | bool = tls if tls is not None else True
        self._limit = max_answer_bytes
        self._session = session
        self._owns_session = session is None

    def _pool(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        return self._session

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    async def _once(self, method: str, url: str, timeout_s: float, **kwargs: Any) -> Answer:
        async with self._pool().request(
            method,
            url,
            ssl=self._ssl,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            **kwargs,
        ) as resp:
            return await read_answer(resp, url, self._limit)

    async def request(
        self,
        method: str,
        url: str,
        *,
        timeout_s: float,
        retry: Retry = NO_RETRY,
        retry_statuses: bool = False,
        **kwargs: Any,
    ) -> Answer:
        """One request, tried up to ``retry.attempts`` times within ``timeout_s``: the answer
        whatever its status (``retry_statuses``: a status of ``retry.statuses`` is tried
        again), or ``Unreachable`` / ``InvalidAnswer``. ``kwargs`` go to aiohttp."""
        deadline = time.monotonic() + timeout_s
        pause = retry.backoff_s
        for attempt in range(1, retry.attempts + 1):
            remaining = max(0.0, deadline - time.monotonic())
            failure: Unreachable | None = None
            try:
                answer = await asyncio.wait_for(
                    self._once(method, url, remaining, **kwargs), remaining
                )
            except asyncio.TimeoutError:  # the deadline: no time left to try again
                raise Unreachable(
                    f"TimeoutError: no answer from {url} within {timeout_s:g}s", url=url
                ) from None
            except (aiohttp.ClientError, OSError) as exc:
                failure = Unreachable(f"{type(exc).__name__}: {printable(exc)}", url=url)
            last_try = attempt == retry.attempts or deadline - time.monotonic() <= pause
            if failure is None:
                if last_try or not (retry_statuses and answer.status in retry.statuses):
                    return answer
            elif last_try:
                raise failure
            await asyncio.sleep(pause)
            pause = min(retry.max_backoff_s, pause * 2)
        raise AssertionError("the loop returns or raises")  # pragma: no cover
