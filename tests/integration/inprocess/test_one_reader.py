"""One reader per deployment of several API servers (``--api-server-count``): API server 0 asks
the engines and publishes each poll's reading in ``PROMETHEUS_MULTIPROC_DIR``; the others build
their ``/dp/status`` from it and ask no engine, and read the engines themselves whenever the
reading is missing, stale or cannot be believed (a stopped leader, a hostile file).

Each API server here has its own simulated engines (the same DP ranks): API server 0's awake,
the others' asleep, so every answer says whose engines it came from.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.sources import READING_FORMAT, PublishedReading
from exporter.inprocess.leader import MAX_READING_BYTES, READING_FILE
from exporter.sim.options import SimOptions
from tests.harness.plugin_app import TOKEN, WAIT_S, PluginApp, plugin_env, start_with_fleet

ENGINES = 3


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Bounded wait for an asynchronous condition."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture
def share_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    token = tmp_path / "admin-token"
    token.write_text(TOKEN + "\n")
    plugin_env(monkeypatch, ADMIN_TOKEN_FILE=str(token))
    directory = tmp_path / "prometheus-multiproc"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    return directory


async def start_server(index: int, count: int) -> PluginApp:
    """API server ``index`` of ``count``; API server 0's engines awake, the others' asleep."""
    options = SimOptions(sleeping=index != 0)
    return await start_with_fleet(
        ENGINES, api_server_index=index, api_server_count=count, options=options
    )


@pytest.fixture
async def deployment(share_dir: Path) -> AsyncIterator[list[PluginApp]]:
    made: list[PluginApp] = []
    try:
        for index in range(3):
            made.append(await start_server(index, 3))
        yield made
    finally:
        for app in reversed(made):
            await app.stop()


async def status(app: PluginApp) -> dict[str, Any]:
    code, body = await app.get_json("/dp/status")
    assert code == 200, body
    assert isinstance(body, dict)
    return body


async def source_of(app: PluginApp) -> dict[str, Any]:
    source = (await status(app))["last_poll"]["source"]
    assert isinstance(source, dict)
    return source


async def sleeping_values(app: PluginApp) -> list[Any]:
    return [e["invariants"]["is_sleeping"]["value"] for e in (await status(app))["engines"]]


async def wait_source(app: PluginApp, wanted: str) -> dict[str, Any]:
    async def there() -> bool:
        return bool((await source_of(app))["from"] == wanted)

    await eventually(there, WAIT_S, f"the poll's source {wanted}")
    return await source_of(app)


def asked(app: PluginApp) -> list[int]:
    assert app.fleet is not None
    return app.fleet.received("is_sleeping")


async def test_one_process_asks_the_others_follow(deployment: list[PluginApp]) -> None:
    leader, *followers = deployment
    assert (await source_of(leader))["role"] == "leader"
    for app in followers:
        source = await wait_source(app, "api_server_0")
        assert source["role"] == "follower" and source["reason"] is None
        assert 0 <= source["age_s"] < 5
    before = [asked(app) for app in deployment]
    exporter = leader.runtime.exporter
    assert exporter is not None
    poll = exporter.poller.snapshot.poll_number
    await exporter.poller.wait_for_poll(poll + 4, WAIT_S)
    for app in followers:  # a follower's poll after the leader's fourth: still no engine asked
        follower = app.runtime.exporter
        assert follower is not None
        await follower.poller.wait_for_poll(follower.poller.snapshot.poll_number + 1, WAIT_S)
    after = [asked(app) for app in deployment]
    assert all(a - b >= 4 for a, b in zip(after[0], before[0], strict=True)), (before, after)
    for index in (1, 2):
        assert after[index] == before[index], (index, before, after)
        # Their engines are asleep; what they show is what API server 0's engines answered.
        assert await sleeping_values(deployment[index]) == [False] * ENGINES
    assert (leader.runtime.reading is not None) and leader.runtime.reading.path.is_file()


async def test_a_follower_reads_itself_once_the_leader_stops(
    deployment: list[PluginApp], share_dir: Path
) -> None:
    leader, follower, _ = deployment
    await wait_source(follower, "api_server_0")
    await leader.stop()
    assert not (share_dir / READING_FILE).exists()  # removed as it stopped
    source = await wait_source(follower, "self")
    assert source["role"] == "follower"
    assert "published no reading" in source["reason"]

    async def own_engines_shown() -> bool:
        return await sleeping_values(follower) == [True] * ENGINES

    await eventually(own_engines_shown, WAIT_S, "the follower's own engines (asleep)")
    assert all(n > 0 for n in asked(follower))
    assert "vllm_dp_engine_up" in await follower.metrics()


# -- a follower without its leader, facing what the file may hold -------------------------------


@pytest.fixture
async def lone_follower(share_dir: Path) -> AsyncIterator[PluginApp]:
    app = await start_server(1, 2)
    try:
        yield app
    finally:
        await app.stop()


def reading(
    *, written: float | None = None, api_server: int = 0, sleeping: list[Any] | None = None
) -> bytes:
    """A reading as API server 0 writes it: every engine awake unless ``sleeping`` says."""
    values = sleeping if sleeping is not None else [False] * ENGINES
    outcomes = {
        "is_sleeping": [EngineOutcome(str(i), Outcome.OK, v) for i, v in enumerate(values)],
        "is_scheduler_paused": [EngineOutcome(str(i), Outcome.OK, False) for i in range(ENGINES)],
    }
    return msgspec.json.encode(
        PublishedReading(
            READING_FORMAT,
            time.time() if written is None else written,
            api_server,
            outcomes,
            {},
        )
    )


def put(share_dir: Path, data: bytes) -> None:
    path = share_dir / READING_FILE
    path.unlink(missing_ok=True)
    path.write_bytes(data)


#: What a file may hold that a follower must not believe (built when the test runs: a reading
#: is fresh only for a few polls), and the reason it gives.
HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "garbage": (lambda: b"\x00\xff not json", "not a reading"),
    "truncated": (lambda: reading()[:40], "not a reading"),
    "another format": (lambda: reading().replace(b'"format":1', b'"format":2'), "format 2"),
    "another writer": (lambda: reading(api_server=1), "written by API server 1"),
    "stale": (lambda: reading(written=time.time() - 3600), "old"),
    "from the future": (lambda: reading(written=time.time() + 3600), "future"),
    "unknown method": (
        lambda: reading().replace(b'"is_scheduler_paused"', b'"sleep"'),
        "methods this exporter does not read",
    ),
    "too large": (lambda: b" " * (MAX_READING_BYTES + 1), "larger than"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_a_reading_it_cannot_believe_is_set_aside(
    lone_follower: PluginApp, share_dir: Path, case: str
) -> None:
    build, reason = HOSTILE[case]

    async def set_aside() -> bool:
        put(share_dir, build())  # kept fresh while the test waits
        source = await source_of(lone_follower)
        return source["from"] == "self" and reason in (source["reason"] or "")

    await eventually(set_aside, WAIT_S, f"the {case} reading set aside")
    assert await sleeping_values(lone_follower) == [True] * ENGINES  # its own engines
    assert "vllm_dp_engine_up" in await lone_follower.metrics()


async def test_a_fifo_in_its_place_is_never_waited_on(
    lone_follower: PluginApp, share_dir: Path
) -> None:
    os.mkfifo(share_dir / READING_FILE)

    async def set_aside() -> bool:
        source = await source_of(lone_follower)
        return source["from"] == "self" and "not a regular file" in (source["reason"] or "")

    await eventually(set_aside, WAIT_S, "the FIFO refused")
    assert "vllm_dp_engine_up" in await lone_follower.metrics()


@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
async def test_a_value_of_the_wrong_type_reads_failed(
    lone_follower: PluginApp, share_dir: Path, position: int
) -> None:
    values: list[Any] = [False] * ENGINES
    values[position] = "yes"
    exporter = lone_follower.runtime.exporter
    assert exporter is not None

    async def followed() -> bool:
        put(share_dir, reading(sleeping=values))  # kept fresh while the test waits
        body = await status(lone_follower)
        return body["last_poll"]["source"]["from"] == "api_server_0" and [
            e["invariants"]["is_sleeping"]["outcome"] for e in body["engines"]
        ] == ["failed" if i == position else "ok" for i in range(ENGINES)]

    await eventually(followed, WAIT_S, "the wrong-typed value read failed")
    body = await status(lone_follower)
    assert body["aggregate"]["is_sleeping"]["outcome"] != "consistent"
    assert (await lone_follower.get("/dp/readyz"))[0] == 503
