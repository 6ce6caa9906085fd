"""``SyncClient``: the same client for code without an event loop (a training script, a
notebook), on the same aiohttp stack.

Each ``SyncClient`` runs one private event loop in a background thread, started by the
constructor and stopped by ``close()`` (or the ``with`` block); every call hands its coroutine
to that loop and blocks until the answer, bounded by the call's timeout. One loop per client,
not one per call: the connection pool is kept between calls, and a caller that already runs an
event loop in its thread (Jupyter) is not in the way. A ``progress`` callback of ``wait`` runs
in the client's thread; it must not call the client (it would wait for itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from exporter.remote.client import (
    ACTION_TIMEOUT_S,
    DEFAULT_ADMIN_URL,
    DEFAULT_URL,
    READ_TIMEOUT_S,
    RESET_TIMEOUT_S,
    VERIFY_TIMEOUT_S,
    Client,
    PauseMode,
    WakeTag,
)
from exporter.remote.credentials import Credentials
from exporter.remote.errors import RemoteError, Unreachable
from exporter.remote.http import Retry
from exporter.remote.results import ActionResult, GateResult
from exporter.remote.status import Status
from exporter.remote.waiting import REQUEST_TIMEOUT_S, CheckpointGoal, ProgressCallback
from exporter.remote.watching import Reconnect, ReconnectCallback, Watch, WatchEvent

T = TypeVar("T")
#: How much longer than its own timeout a call may take before the caller stops waiting for
#: the loop (which bounds the call itself): a stuck loop never blocks the caller for good.
GRACE_S = 5.0


class SyncClient:
    """``Client``'s methods, blocking. ``with SyncClient(...) as client: client.pause()``."""

    def __init__(
        self,
        url: str | None = DEFAULT_URL,
        admin_url: str | None = DEFAULT_ADMIN_URL,
        *,
        credentials: Credentials | None = None,
        retry: Retry | None = None,
        auto_idempotency_keys: bool = False,
    ) -> None:
        self._client = Client(  # checks the URLs and credentials before a thread starts
            url,
            admin_url,
            credentials=credentials,
            retry=retry,
            auto_idempotency_keys=auto_idempotency_keys,
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="exporter-remote", daemon=True
        )
        self._thread.start()
        self._closed = False

    @property
    def client(self) -> Client:
        """The async client underneath (its methods run in this client's loop only)."""
        return self._client

    def __repr__(self) -> str:
        return f"Sync{self._client!r}"

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections and stop the loop's thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            future = asyncio.run_coroutine_threadsafe(self._client.close(), self._loop)
            future.result(GRACE_S)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(GRACE_S)
            if not self._thread.is_alive():
                self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        if self._closed or threading.current_thread() is self._thread:
            coro.close()
            why = "is closed" if self._closed else "was called from its own thread"
            raise RuntimeError(f"this SyncClient {why}")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s + GRACE_S)
        except concurrent.futures.TimeoutError:
            if future.done():  # the call's own error: WaitTimeout is a TimeoutError too
                raise
            future.cancel()
            raise Unreachable(
                f"TimeoutError: no answer within {timeout_s + GRACE_S:g}s (the client's loop "
                "did not finish the call)"
            ) from None
        except BaseException:  # KeyboardInterrupt: stop the call too
            future.cancel()
            raise

    # -- reads ------------------------------------------------------------------------------

    def status(self, *, timeout_s: float = READ_TIMEOUT_S) -> Status:
        return self._call(self._client.status(timeout_s=timeout_s), timeout_s)

    def gate(
        self,
        *,
        drained: bool | None = None,
        checkpoint: CheckpointGoal | None = None,
        timeout_s: float = READ_TIMEOUT_S,
        **conditions: Any,
    ) -> GateResult:
        coro = self._client.gate(
            drained=drained, checkpoint=checkpoint, timeout_s=timeout_s, **conditions
        )
        return self._call(coro, timeout_s)

    def wait(
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
        coro = self._client.wait(
            conditions,
            timeout_s,
            drained=drained,
            checkpoint=checkpoint,
            progress=progress,
            interval_s=interval_s,
            request_timeout_s=request_timeout_s,
        )
        return self._call(coro, timeout_s + request_timeout_s)

    def watch(
        self,
        last_event_id: str | None = None,
        *,
        reconnect: Reconnect | None = None,
        on_reconnect: ReconnectCallback | None = None,
    ) -> SyncWatch:
        """``Client.watch`` as a plain iterator: ``with dp.watch() as events: for event in
        events``; ``on_reconnect`` runs in the client's thread."""
        watch = self._client.watch(last_event_id, reconnect=reconnect, on_reconnect=on_reconnect)
        return SyncWatch(watch, self)

    # -- admin actions ----------------------------------------------------------------------

    def action(
        self,
        name: str,
        params: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.action(
            name, params, body, idempotency_key=idempotency_key, timeout_s=timeout_s
        )
        return self._call(coro, timeout_s)

    def reset_prefix_cache(
        self,
        *,
        reset_running_requests: bool = False,
        reset_connector: bool = False,
        idempotency_key: str | None = None,
        timeout_s: float = RESET_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.reset_prefix_cache(
            reset_running_requests=reset_running_requests,
            reset_connector=reset_connector,
            idempotency_key=idempotency_key,
            timeout_s=timeout_s,
        )
        return self._call(coro, timeout_s)

    def sleep(
        self,
        level: int = 1,
        mode: PauseMode | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.sleep(level, mode, idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def wake_up(
        self,
        tags: Sequence[WakeTag] | str | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.wake_up(tags, idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def pause(
        self,
        mode: PauseMode | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.pause(mode, idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def resume(
        self, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        coro = self._client.resume(idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def weight_version(
        self,
        version: str,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.weight_version(
            version, idempotency_key=idempotency_key, timeout_s=timeout_s
        )
        return self._call(coro, timeout_s)

    set_weight_version = weight_version

    def reset_mm_cache(
        self, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        coro = self._client.reset_mm_cache(idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def reset_encoder_cache(
        self, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        coro = self._client.reset_encoder_cache(
            idempotency_key=idempotency_key, timeout_s=timeout_s
        )
        return self._call(coro, timeout_s)

    def verify_weights(
        self, *, idempotency_key: str | None = None, timeout_s: float = VERIFY_TIMEOUT_S
    ) -> ActionResult:
        coro = self._client.verify_weights(idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)

    def checkpoint_prepare(
        self,
        mode: PauseMode | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        coro = self._client.checkpoint_prepare(
            mode, idempotency_key=idempotency_key, timeout_s=timeout_s
        )
        return self._call(coro, timeout_s)

    def checkpoint_restore(
        self, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        coro = self._client.checkpoint_restore(idempotency_key=idempotency_key, timeout_s=timeout_s)
        return self._call(coro, timeout_s)


class SyncWatch:
    """``Watch`` as a plain iterator (``SyncClient.watch``): ``with client.watch() as events:
    for event in events``. Each ``next`` blocks until the next event, in the client's loop
    (bounded by ``Reconnect.bound_s``: a stuck loop never blocks the caller for good);
    ``close()`` or the block ends it."""

    def __init__(self, watch: Watch, client: SyncClient) -> None:
        self.watch = watch
        self._client = client

    def __repr__(self) -> str:
        return f"Sync{self.watch!r}"

    @property
    def last_event_id(self) -> str | None:
        return self.watch.last_event_id

    def __iter__(self) -> SyncWatch:
        return self

    def __next__(self) -> WatchEvent:
        coro = self.watch.next_event()
        event = self._client._call(coro, self.watch.reconnect.bound_s())
        if event is None:
            raise StopIteration
        return event

    def __enter__(self) -> SyncWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (idempotent; nothing left to close once the client is)."""
        with contextlib.suppress(RuntimeError, RemoteError):
            self._client._call(self.watch.aclose(), GRACE_S)
