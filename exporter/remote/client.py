"""``Client``: a running exporter's HTTP surface from asyncio code (aiohttp).

Every admin action (``POST <admin_url>/admin/<action>``; by name: ``exporter.remote.actions``),
the gate (``GET <url>/gate``) and the status document (``GET <url>/status``), with typed results
and typed errors (``exporter.remote.results``, ``exporter.remote.errors``). ``ctl`` and the
demo's trainer make their calls through it: one HTTP path in the code base talks to an exporter.

Retries only where they are safe: reads (``status``, ``gate``) are retried after a connection
error or a transient 5xx; a state-changing action only when it carries an Idempotency-Key,
because the exporter then answers a repeat with the first answer instead of running the action
twice. Every call is bounded by its ``timeout_s``, retries included. Redirects are never
followed (they would carry the credentials to another address).
"""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import aiohttp

from exporter.error import ConfigError
from exporter.remote.actions import ACTION_TIMEOUT_S as ACTION_TIMEOUT_S
from exporter.remote.actions import RESET_TIMEOUT_S as RESET_TIMEOUT_S
from exporter.remote.actions import VERIFY_TIMEOUT_S as VERIFY_TIMEOUT_S
from exporter.remote.actions import NamedActions
from exporter.remote.actions import PauseMode as PauseMode
from exporter.remote.actions import WakeTag as WakeTag
from exporter.remote.answers import (
    MAX_ANSWER_BYTES,
    UNSUPPORTED_STATUS,
    Answer,
    error_for,
    printable,
)
from exporter.remote.credentials import Credentials
from exporter.remote.errors import (
    BadRequest,
    InvalidAnswer,
    NoEngineConnected,
    PartialFailure,
    Unsupported,
)
from exporter.remote.http import NO_RETRY, Http, Retry
from exporter.remote.results import ActionResult, GateResult
from exporter.remote.status import Status
from exporter.remote.urls import base_url, join
from exporter.remote.waiting import (
    REQUEST_TIMEOUT_S,
    CheckpointGoal,
    ProgressCallback,
    query,
    wait_for_gate,
    with_checkpoint,
    with_drained,
)
from exporter.remote.watching import Reconnect, ReconnectCallback, Watch

DEFAULT_URL = "http://127.0.0.1:19400"
DEFAULT_ADMIN_URL = "http://127.0.0.1:19401"
#: A read: /status and one gate check.
READ_TIMEOUT_S = 10.0
_ACTION_NAME = re.compile(r"[a-z][a-z_]{0,63}")
T = TypeVar("T")


def _parsed(answer: Answer, parse: Callable[[dict[str, Any]], T]) -> T:
    """``parse`` of the answer's JSON object; InvalidAnswer (with the status) otherwise."""
    if answer.body is None:
        raise InvalidAnswer(answer.message, status=answer.status, url=answer.url)
    try:
        return parse(answer.body)
    except InvalidAnswer as exc:
        raise InvalidAnswer(
            f"HTTP {answer.status}: {exc}", status=answer.status, body=answer.body, url=answer.url
        ) from None


def _failure_line(result: ActionResult) -> str:
    why = "; ".join(f"engine {e.engine}: {e.reason or 'failed'}" for e in result.failures)
    return printable(f"{result.action}: {result.outcome} ({why or result.error or 'no engine'})")


class Client(NamedActions):
    """A client of one exporter: ``url`` its metrics listener (``/status``, ``/gate``),
    ``admin_url`` its admin listener (``/admin/<action>``); either may be None when unused.
    With the vLLM plugin both are ``http://host:8000/dp``.

    Use it as ``async with Client(...) as client:`` (or ``await client.close()``): it holds
    one connection pool, made on first use in the running event loop. ``timeout_s`` of a
    call bounds it whole, retries included; ``auto_idempotency_keys`` gives every action
    without an explicit key a fresh one, so that its retries are safe too.
    """

    def __init__(
        self,
        url: str | None = DEFAULT_URL,
        admin_url: str | None = DEFAULT_ADMIN_URL,
        *,
        credentials: Credentials | None = None,
        retry: Retry | None = None,
        auto_idempotency_keys: bool = False,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.url = base_url(url, "URL") if url is not None else None
        self.admin_url = base_url(admin_url, "admin URL") if admin_url is not None else None
        self.credentials = credentials or Credentials()
        self.retry = retry if retry is not None else Retry()
        self.auto_idempotency_keys = auto_idempotency_keys
        self._http = Http(self.credentials.ssl_context(), max_answer_bytes, session)
        self._watches: weakref.WeakSet[Watch] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"Client(url={self.url!r}, admin_url={self.admin_url!r}, {self.credentials!r})"

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End every watch and close the connection pool (not a session given to the
        constructor)."""
        for watch in list(self._watches):
            watch.stop()
        await self._http.close()

    def _where(self, base: str | None, what: str, route: str) -> str:
        if base is None:
            raise ConfigError(f"this client was made without {what}")
        return join(base, route)

    def _headers(self, authorization: str | None, key: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if authorization is not None:
            headers["Authorization"] = authorization
        if key is not None:
            headers["Idempotency-Key"] = key
        return headers

    # -- reads ------------------------------------------------------------------------------

    async def status(self, *, timeout_s: float = READ_TIMEOUT_S) -> Status:
        """``GET <url>/status``, typed (``Status.raw``: the whole document)."""
        url = self._where(self.url, "a URL", "status")
        answer = await self._http.request(
            "GET",
            url,
            timeout_s=timeout_s,
            retry=self.retry,
            retry_statuses=True,
            headers=self._headers(self.credentials.read_authorization()),
        )
        if answer.status != 200:
            raise error_for(answer)
        return _parsed(answer, Status.from_json)

    async def gate(
        self,
        *,
        drained: bool | None = None,
        checkpoint: CheckpointGoal | None = None,
        timeout_s: float = READ_TIMEOUT_S,
        retry: Retry | None = None,
        **conditions: Any,
    ) -> GateResult:
        """One ``GET <url>/gate?<conditions>`` (``weight_version="v7"``, ``sleeping=False``,
        ``paused=False``, ``healthy=True``): open (``ok``) or closed (412: what fails; 503: no
        engine). ``drained=True`` holds when every rank answered ``has_work`` false and no
        published request count is above zero (``False``: every rank has work; None: not
        asked); each engine's ``requests`` are its running and waiting counts where the
        attach mode knows them. A question the gate rejects raises (``BadRequest`` for an
        unknown condition, or a ``drained`` that is not a boolean; ``Unsupported``, 501, for
        a condition no engine can answer, e.g. ``drained`` where no vLLM has ``has_work``).
        ``checkpoint="prepared"`` (or ``"running"``): every rank's vLLM 0.34 checkpoint state."""
        wanted = with_checkpoint(with_drained(conditions, drained), checkpoint)
        return await self._gate(wanted, timeout_s, retry)

    async def _gate(
        self, conditions: Mapping[str, Any], timeout_s: float, retry: Retry | None
    ) -> GateResult:
        url = self._where(self.url, "a URL", "gate")
        answer = await self._http.request(
            "GET",
            url,
            timeout_s=timeout_s,
            retry=self.retry if retry is None else retry,
            retry_statuses=True,
            params=query(conditions),
            headers=self._headers(self.credentials.read_authorization()),
        )
        if answer.status == UNSUPPORTED_STATUS:
            names = answer.body.get("unsupported") if isinstance(answer.body, dict) else None
            unanswerable = tuple(str(n) for n in names) if isinstance(names, list) else ()
            raise Unsupported(
                answer.message,
                conditions=unanswerable,
                status=answer.status,
                body=answer.body,
                detail=answer.detail,
                url=url,
            )
        if answer.status not in (200, 412, 503):
            raise error_for(answer)
        return _parsed(answer, lambda body: GateResult.from_json(answer.status, body))

    async def wait(
        self,
        conditions: Mapping[str, Any] | None = None,
        timeout_s: float = 300.0,
        *,
        drained: bool | None = None,
        checkpoint: CheckpointGoal | None = None,
        progress: ProgressCallback | None = None,
        interval_s: float = 1.0,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> GateResult:
        """Ask the gate every ``interval_s`` until it opens (its answer) or ``timeout_s``
        passes (``WaitTimeout``, with the last answer). ``drained=True`` adds the condition
        that every rank has finished its work (as ``gate``; the same as ``{"drained": True}``
        in ``conditions``); ``checkpoint="prepared"`` that every rank can be captured
        (``"running"``: every one serves again). ``progress`` sees every closed answer and
        every retried failure (``exporter.remote.waiting``): ``Progress.summary`` names the
        ranks that still fail, with their counts or checkpoint errors where known."""
        # BadRequest at once, never retried.
        wanted = with_checkpoint(with_drained(conditions, drained), checkpoint)

        async def check(request_timeout: float) -> GateResult:
            return await self._gate(wanted, request_timeout, NO_RETRY)

        return await wait_for_gate(
            check,
            wanted,
            timeout_s,
            interval_s=interval_s,
            progress=progress,
            request_timeout_s=request_timeout_s,
        )

    def watch(
        self,
        last_event_id: str | None = None,
        *,
        reconnect: Reconnect | None = None,
        on_reconnect: ReconnectCallback | None = None,
    ) -> Watch:
        """``GET <url>/watch``: every rank's row, then each change, as ``WatchEvent``s
        (``async with client.watch() as events: async for event in events``), resumed after a
        dropped connection from the last id received (``exporter.remote.watching``)."""
        url = self._where(self.url, "a URL", "watch")
        authorization = self.credentials.read_authorization()
        watch = Watch(self._http, url, authorization, last_event_id, reconnect, on_reconnect)
        self._watches.add(watch)
        return watch

    # -- admin actions ----------------------------------------------------------------------

    async def action(
        self,
        name: str,
        params: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """``POST <admin_url>/admin/<name>``: the result when every engine confirmed;
        ``PartialFailure`` (502) with the result when some engine did not confirm;
        ``Unsupported`` (501) when no engine supports the action; the typed error of any other
        answer."""
        if not _ACTION_NAME.fullmatch(name):
            raise BadRequest(f"{name!r} is not an admin action name")
        key = idempotency_key
        if key is None and self.auto_idempotency_keys:
            key = f"exporter-remote-{uuid.uuid4().hex}"
        if key is not None and not (0 < len(key) <= 200 and key.isprintable() and key.isascii()):
            raise BadRequest("Idempotency-Key must be 1-200 printable ASCII characters")
        url = self._where(self.admin_url, "an admin URL", f"admin/{name}")
        answer = await self._http.request(
            "POST",
            url,
            timeout_s=timeout_s,
            retry=self.retry if key is not None else NO_RETRY,
            params=dict(params or {}),
            json=dict(body) if body is not None else None,
            headers=self._headers(self.credentials.admin_authorization(), key),
        )
        if answer.status not in (200, UNSUPPORTED_STATUS, 502, 503):
            raise error_for(answer)
        result = _parsed(
            answer, lambda raw: ActionResult.from_json(name, answer.status, raw, answer.replayed)
        )
        common: dict[str, Any] = {
            "status": answer.status,
            "body": answer.body,
            "detail": answer.detail,
            "url": url,
        }
        if answer.status == 502:
            raise PartialFailure(_failure_line(result), result=result, **common)
        if answer.status == UNSUPPORTED_STATUS:
            raise Unsupported(_failure_line(result), result=result, **common)
        if answer.status == 503:
            raise NoEngineConnected(answer.message, result=result, **common)
        return result
