"""``SyncClient``: ``Client``'s calls blocking, on one private loop thread per client. Its
own rules: a call's error comes back as raised, a stuck loop never blocks the caller for good,
and a closed client (or a call from its own thread) refuses instead of hanging. The requests
go to an in-memory ``Http`` (no sockets)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.error import ConfigError
from exporter.remote.answers import Answer
from exporter.remote.errors import PartialFailure, Unreachable, WaitTimeout
from exporter.remote.http import NO_RETRY, Http, Retry
from exporter.remote.sync import SyncClient
from exporter.remote.waiting import Progress

HANG = -1


class ScriptedHttp(Http):
    """Answers in turn (``HANG``: never answers); notes the thread and any cancellation."""

    def __init__(self, *answers: tuple[int, dict[str, Any]]) -> None:
        super().__init__(None, 1024)
        self.answers = list(answers)
        self.threads: list[str] = []
        self.params: list[dict[str, str]] = []
        self.cancelled = threading.Event()

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
        self.threads.append(threading.current_thread().name)
        self.params.append(kwargs.get("params", {}))
        status, body = self.answers.pop(0)
        if status == HANG:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        return Answer(url, status, body)


@pytest.fixture
def sync() -> Iterator[SyncClient]:
    client = SyncClient("http://h:19400", "http://h:19401")
    yield client
    client.close()


def script(sync: SyncClient, *answers: tuple[int, dict[str, Any]]) -> ScriptedHttp:
    http = ScriptedHttp(*answers)
    sync.client._http = http
    return http


def remote_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "exporter-remote")


def test_a_call_runs_on_the_client_s_thread_and_blocks_for_its_answer(sync: SyncClient) -> None:
    http = script(sync, (200, {"attach": "owner"}), (200, {"engines": []}))
    assert sync.status().attach == "owner"
    assert sync.sleep(2, "keep").status == 200
    assert http.threads == ["exporter-remote", "exporter-remote"]
    assert http.params[1] == {"level": "2", "mode": "keep"}


def test_the_call_s_own_error_is_raised_as_it_is(sync: SyncClient) -> None:
    script(sync, (502, {"engines": [{"engine": 0, "ok": False, "reason": "timeout"}]}))
    with pytest.raises(PartialFailure) as partial:
        sync.pause()
    assert partial.value.result.failures[0].reason == "timeout"


def test_a_wait_timeout_is_not_mistaken_for_a_stuck_loop(sync: SyncClient) -> None:
    """WaitTimeout is a TimeoutError, as is the caller's own wait for the loop."""
    script(sync, *[(412, {"engines": []})] * 50)
    with pytest.raises(WaitTimeout) as late:
        sync.wait({"paused": False}, 0.0, interval_s=0.01)
    assert late.value.last_error == "HTTP 412"


def test_a_stuck_call_gives_up_and_is_cancelled(
    sync: SyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("exporter.remote.sync.GRACE_S", 0.05)
    http = script(sync, (HANG, {}), (200, {"attach": "relay"}))
    with pytest.raises(Unreachable, match=r"no answer within 0\.1s"):
        sync.status(timeout_s=0.05)
    assert http.cancelled.wait(5.0)
    assert sync.status().attach == "relay"  # the loop still serves the next call


def test_a_progress_callback_must_not_call_its_client(sync: SyncClient) -> None:
    script(sync, (412, {"engines": []}), (200, {}))

    def progress(p: Progress) -> None:
        sync.status()

    with pytest.raises(RuntimeError, match="was called from its own thread"):
        sync.wait({}, 5.0, progress=progress, interval_s=0.01)


def test_a_closed_client_refuses_and_its_thread_is_gone() -> None:
    before = remote_threads()
    with SyncClient("http://h:19400", None) as client:
        assert remote_threads() == before + 1
    assert remote_threads() == before
    client.close()  # twice: nothing happens
    with pytest.raises(RuntimeError, match="this SyncClient is closed"):
        client.status()


def test_bad_settings_fail_before_a_thread_starts() -> None:
    before = remote_threads()
    with pytest.raises(ConfigError, match="admin URL"):
        SyncClient("http://h:19400", "http://user:pw@h:19401")
    assert remote_threads() == before


def test_the_repr_is_the_async_client_s(sync: SyncClient) -> None:
    assert repr(sync) == "Sync" + repr(sync.client)
    assert repr(sync).startswith("SyncClient(url='http://h:19400', admin_url='http://h:19401'")
