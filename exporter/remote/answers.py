"""One HTTP answer of an exporter, read with bounds and turned into data or a typed error.

Whatever listens at the URL is not trusted to be an exporter: the body is read up to a bound
(a ``Content-Length`` above it is refused before reading), JSON that nests too deeply or is not
an object is an ``InvalidAnswer``, and every string quoted in an error has its control
characters escaped (``printable``), so an answer cannot rewrite the terminal that prints it.
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from exporter.remote.errors import (
    AuthError,
    BadRequest,
    Conflict,
    Forbidden,
    HttpError,
    IdempotencyKeyReused,
    InvalidAnswer,
    NoEngineConnected,
    NotFound,
    RateLimited,
    RemoteError,
)

#: Largest answer read (a /status of a thousand engines with its history is a few MiB).
MAX_ANSWER_BYTES = 32 * 2**20
#: What the exporter answers for something no engine supports (an action, a gate condition).
UNSUPPORTED_STATUS = 501
#: Longest stretch of a non-JSON answer quoted in an error.
MAX_QUOTED = 200
#: Longest error text kept from an answer (``detail``).
MAX_DETAIL = 2000


def printable(value: Any) -> str:
    """``str(value)`` with every unprintable character (C0/C1 controls such as ESC, CR, LF and
    TAB; DEL; format characters such as bidi overrides; line and paragraph separators)
    written as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text) - limit} more)"


@dataclass(frozen=True)
class Answer:
    """What one request got back: the status, the JSON object (None when the body was not
    one, ``problem`` then says why), and the headers the client acts on."""

    url: str
    status: int
    body: dict[str, Any] | None
    problem: str | None = None
    retry_after: float | None = None
    replayed: bool = False
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def detail(self) -> str:
        """The exporter's error text (or the whole body, or why it could not be read)."""
        if self.body is None:
            return self.problem or f"HTTP {self.status}: no answer body"
        return _cut(printable(self.body.get("error", self.body)), MAX_DETAIL)

    @property
    def message(self) -> str:
        """One line saying what came back: ``HTTP 409: an admin action ... is running``."""
        return self.detail if self.body is None else f"HTTP {self.status}: {self.detail}"


def decode(status: int, raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object of a body, or None and why it is not one."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: "[" nested past the decoder
        quoted = printable(raw[:MAX_QUOTED].decode("utf-8", "replace").strip())
        return None, f"HTTP {status}: the answer is not JSON: {quoted}"
    if not isinstance(body, dict):
        return None, f"HTTP {status}: the answer is not a JSON object"
    return body, None


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """``Retry-After`` in seconds: a number of seconds or an HTTP date; None if absent or
    unreadable, never negative."""
    if value is None:
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


async def read_answer(resp: aiohttp.ClientResponse, url: str, limit: int) -> Answer:
    """Read ``resp`` (at most ``limit`` bytes) into an ``Answer``."""
    status = resp.status
    if resp.content_length is not None and resp.content_length > limit:
        raise InvalidAnswer(
            f"HTTP {status}: the answer is {resp.content_length} bytes, more than the "
            f"{limit} this client reads",
            status=status,
            url=url,
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(2**16):
        size += len(chunk)
        if size > limit:
            raise InvalidAnswer(
                f"HTTP {status}: the answer is larger than the {limit} bytes this client reads",
                status=status,
                url=url,
            )
        chunks.append(chunk)
    body, problem = decode(status, b"".join(chunks))
    return Answer(
        url,
        status,
        body,
        problem,
        retry_after=parse_retry_after(resp.headers.get("Retry-After")),
        replayed=resp.headers.get("Idempotency-Replayed", "").lower() == "true",
        headers=dict(resp.headers),
    )


#: Status → the error class of an answer that is not a success (502 and 503 of an action
#: carry the action's result: the client raises those itself).
ERRORS: dict[int, type[RemoteError]] = {
    400: BadRequest,
    401: AuthError,
    403: Forbidden,
    404: NotFound,
    405: NotFound,
    408: BadRequest,
    409: Conflict,
    413: BadRequest,
    422: IdempotencyKeyReused,
    429: RateLimited,
    503: NoEngineConnected,
}


def error_for(answer: Answer) -> RemoteError:
    """The typed error of an answer that is not a success."""
    kind = ERRORS.get(answer.status, HttpError)
    common: dict[str, Any] = {
        "status": answer.status,
        "body": answer.body,
        "detail": answer.detail,
        "url": answer.url,
    }
    if kind is RateLimited:
        return RateLimited(answer.message, retry_after=answer.retry_after, **common)
    return kind(answer.message, **common)
