"""Two of vLLM's API servers (``--api-server-count 2``) in one test process: each its own
FastAPI app with the plugin, its own simulated ``AsyncLLM`` (API server 0 and 1 of 2) and its
own simulated engines (the same DP ranks), with ``PROMETHEUS_MULTIPROC_DIR`` shared, as vLLM
sets it. A scrape of either shows every ``vllm_dp_*`` series once: gauges as API server 0 saw
them, counters summed over both. Files in the directory that cannot be believed are skipped
(with one warning each) and the scrape still answers; each server removes its own file when its
app stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from exporter.inprocess.shared import ProcessShare
from exporter.inprocess.vllm_facts import ApiServer
from exporter.sim.options import SimOptions
from tests.harness.plugin_app import (
    TOKEN,
    WAIT_S,
    PluginApp,
    plugin_env,
    start_with_fleet,
    vllm_series,
)
from tests.harness.scrape import Families, metric_value, parse_metrics
from tests.harness.waiting import eventually

RESETS = {"action": "reset_prefix_cache", "code": "200"}


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S) -> None:
    """Bounded wait for an asynchronous condition."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def sample_keys(text: str) -> list[str]:
    """Every sample line's name and labels (the line without its value)."""
    return [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and line[0] != "#"]


def assert_each_series_once(text: str) -> None:
    keys = Counter(sample_keys(text))
    assert not [k for k, n in keys.items() if n > 1], [k for k, n in keys.items() if n > 1]
    types = Counter(line for line in text.splitlines() if line.startswith("# TYPE "))
    assert not [t for t, n in types.items() if n > 1]


@pytest.fixture
def share_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    token = tmp_path / "admin-token"
    token.write_text(TOKEN + "\n")
    plugin_env(monkeypatch, ADMIN_TOKEN_FILE=str(token))
    directory = tmp_path / "prometheus-multiproc"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    return directory


@pytest.fixture
async def api_servers(share_dir: Path) -> AsyncIterator[tuple[PluginApp, PluginApp]]:
    """API server 0 (its engines awake) and API server 1 (its engines asleep) of 2."""
    made: list[PluginApp] = []
    with vllm_series():
        try:
            made.append(await start_with_fleet(2, api_server_index=0, api_server_count=2))
            made.append(
                await start_with_fleet(
                    2,
                    api_server_index=1,
                    api_server_count=2,
                    options=SimOptions(sleeping=True),
                )
            )
            first, second = made
            for index, app in enumerate(made):
                assert app.runtime.server == ApiServer(index, 2)
                assert app.runtime.share is not None
            paths = [share_dir / f"vllm_dp_exporter.{i}.json" for i in (0, 1)]
            await until(lambda: _exist(paths), "both API servers' files")
            yield first, second
        finally:
            for app in reversed(made):
                await app.stop()


async def _exist(paths: list[Path]) -> bool:
    return all(p.exists() for p in paths)


async def scrape(app: PluginApp) -> tuple[str, Families]:
    text = await app.metrics()
    return text, parse_metrics(text)


async def test_gauges_from_server_0_once_counters_summed(
    api_servers: tuple[PluginApp, PluginApp],
) -> None:
    first, second = api_servers
    for _ in range(2):
        status, body, _ = await second.post("reset_prefix_cache", token=TOKEN)
        assert status == 200, body
    status, body, _ = await first.post("reset_prefix_cache", token=TOKEN)
    assert status == 200, body

    async def both_count_three() -> bool:
        for app in api_servers:
            _, families = await scrape(app)
            if metric_value(families, "vllm_dp_admin_requests", **RESETS) != 3.0:
                return False
        return True

    await until(both_count_three, "every reset counted in both API servers' scrapes")
    for app in api_servers:
        text, families = await scrape(app)
        assert_each_series_once(text)
        assert "vllm:dp_plugin_test_marker 42.0" not in text  # multiprocess: vLLM's .db files
        # Gauges: API server 0's view only (its engines are awake, server 1's asleep).
        for engine in ("0", "1"):
            assert metric_value(families, "vllm_dp_engine_sleeping", engine=engine) == 0.0
            assert metric_value(families, "vllm_dp_engine_up", engine=engine) == 1.0
        assert metric_value(families, "vllm_dp_engines_expected") == 2.0
        assert metric_value(families, "vllm_dp_sleeping") == 0.0
        # Counters: what happened in both processes.
        for engine in ("0", "1"):
            assert (
                metric_value(
                    families,
                    "vllm_dp_utility_calls",
                    method="reset_prefix_cache",
                    engine=engine,
                    outcome="ok",
                )
                == 3.0
            )
        assert metric_value(families, "vllm_dp_prefix_cache_resets", outcome="success") == 3.0
        reset_counts = [
            s.value
            for s in families["vllm_dp_prefix_cache_reset_duration_seconds"].samples
            if s.name.endswith("_count")
        ]
        assert reset_counts == [3.0]
    # Each process's own state stays its own.
    assert first.runtime.exporter is not None and second.runtime.exporter is not None
    assert first.runtime.exporter.stats.admin_requests[("reset_prefix_cache", "200")] == 1
    assert second.runtime.exporter.stats.admin_requests[("reset_prefix_cache", "200")] == 2
    assert second.fleet is not None and second.fleet.received("reset_prefix_cache") == [2, 2]


def _valid_share(count: float) -> bytes:
    """A believable file claiming ``count`` resets (it must never be read)."""
    return json.dumps(
        [
            {
                "name": "vllm_dp_admin_requests_total",
                "labels": ["action", "code"],
                "rows": [[["reset_prefix_cache", "200"], count]],
            },
            {"name": "vllm_dp_engine_up", "labels": ["engine"], "rows": [[["0"], 0]]},
        ]
    ).encode()


async def test_files_that_cannot_be_believed_are_skipped(
    api_servers: tuple[PluginApp, PluginApp],
    share_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    first, second = api_servers
    status, _, _ = await second.post("reset_prefix_cache", token=TOKEN)
    assert status == 200

    async def counted() -> bool:
        _, families = await scrape(first)
        return metric_value(families, "vllm_dp_admin_requests", **RESETS) == 1.0

    await until(counted, "API server 1's reset in API server 0's scrape")

    bad = {
        2: b"\xff\xfe{ not json",
        3: b'{"families": []}',
        4: json.dumps([{"name": "vllm_dp_nope_total", "labels": [], "rows": []}]).encode(),
        5: json.dumps(
            [{"name": "vllm_dp_polls_total", "labels": [], "rows": [[[], True]]}]
        ).encode(),
        6: json.dumps(
            [{"name": "vllm_dp_engine_up", "labels": ["engine"], "rows": [[["0", "x"], 1]]}]
        ).encode(),
        7: b"[" * 100_000,
        8: json.dumps(
            [{"name": "vllm_dp_polls_total", "labels": [], "rows": [[[], 10**400]]}]
        ).encode(),
        9: json.dumps(
            [
                {
                    "name": "vllm_dp_relay_handshakes_total",
                    "labels": ['result="x"} 1\nvllm_dp_injected{a'],
                    "rows": [[["y"], 1]],
                }
            ]
        ).encode(),
    }
    for index, data in bad.items():
        (share_dir / f"vllm_dp_exporter.{index}.json").write_bytes(data)
    huge = share_dir / "vllm_dp_exporter.10.json"
    with huge.open("wb") as handle:
        handle.truncate(20 * 1024 * 1024)  # 20 MB (sparse): never read
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes(_valid_share(1000))
    (share_dir / "vllm_dp_exporter.11.json").symlink_to(outside)
    stale = share_dir / "vllm_dp_exporter.12.json"
    stale.write_bytes(_valid_share(1000))
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    (share_dir / "vllm_dp_exporter.x.json").write_bytes(_valid_share(1000))  # not a name
    (share_dir / "vllm_dp_exporter.13.json.tmp").write_bytes(_valid_share(1000))

    with caplog.at_level(logging.WARNING, logger="exporter.inprocess"):
        for app in (first, second, first, second):  # twice each: warnings are rate limited
            text, families = await scrape(app)
            assert_each_series_once(text)
            assert "vllm_dp_injected" not in text
            assert "vllm_dp_relay_handshakes_total" not in text
            assert metric_value(families, "vllm_dp_admin_requests", **RESETS) == 1.0
            assert metric_value(families, "vllm_dp_engine_up", engine="0") == 1.0
    warned = Counter(
        name
        for record in caplog.records
        if record.name == "exporter.inprocess"
        for name in [Path(record.getMessage().split(":", 1)[0]).name]
    )
    expected = {f"vllm_dp_exporter.{i}.json" for i in (*bad, 10, 11)}
    # One warning per bad file and process (each process warns once a minute per file).
    assert warned == dict.fromkeys(expected, 2), warned
    assert stale.exists()  # stale files are not touched, only skipped (a process gone)


async def test_each_server_removes_its_own_file_when_its_app_stops(
    api_servers: tuple[PluginApp, PluginApp], share_dir: Path
) -> None:
    first, second = api_servers
    own = [share_dir / f"vllm_dp_exporter.{i}.json" for i in (0, 1)]
    status, _, _ = await second.post("reset_prefix_cache", token=TOKEN)
    assert status == 200

    async def counted() -> bool:
        _, families = await scrape(first)
        return metric_value(families, "vllm_dp_admin_requests", **RESETS) == 1.0

    await until(counted, "API server 1's reset in API server 0's scrape")
    await second.stop()  # its lifespan ends
    assert not own[1].exists() and own[0].exists()
    _, families = await scrape(first)
    # Server 1's counts left with its file; the scrape is server 0's own again.
    assert metric_value(families, "vllm_dp_admin_requests", **RESETS) is None
    await first.stop()
    assert not own[0].exists()
    assert sorted(p.name for p in share_dir.iterdir()) == []


def test_share_without_a_directory_is_warned_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory that vanished: the scrape is this process's own, one warning a minute."""
    share = ProcessShare(str(tmp_path / "gone"), 1, list, lambda: 0)
    with caplog.at_level(logging.WARNING, logger="exporter.inprocess"):
        assert share.merged([]) == []
        assert share.merged([]) == []
    assert len([r for r in caplog.records if "cannot list" in r.getMessage()]) == 1


async def test_a_write_in_flight_at_stop_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publishing task is cancelled while its write runs in a thread (which a cancel does
    not stop): the file that write puts in place after ``remove()`` is removed too."""
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    real_replace = os.replace

    def slow_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        entered.set()
        try:
            release.wait(WAIT_S)
            real_replace(src, dst)
        finally:
            done.set()

    monkeypatch.setattr("exporter.inprocess.shared.os.replace", slow_replace)
    share = ProcessShare(str(tmp_path), 1, list, lambda: 0)
    task = asyncio.create_task(share.run(0.05))
    assert await asyncio.to_thread(entered.wait, WAIT_S)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    share.remove()  # as InProcessRuntime.stop: after the task, before the thread is done
    release.set()
    assert await asyncio.to_thread(done.wait, WAIT_S)
    await eventually(lambda: not share.path.exists(), WAIT_S, "the late file removed")
    assert list(tmp_path.iterdir()) == []
    share.write(b"[]")  # and never written again
    assert list(tmp_path.iterdir()) == []


async def test_counters_never_go_back_whichever_server_answers(
    api_servers: tuple[PluginApp, PluginApp],
) -> None:
    """An admin request on API server 1, then scrapes of server 1 and at once of server 0:
    every counter seen is at least what the scrape before saw (each server sums the same
    published snapshots, its own included, not its own live state)."""
    first, second = api_servers
    seen: dict[str, float] = {}
    for _ in range(5):
        status, body, _ = await second.post("reset_prefix_cache", token=TOKEN)
        assert status == 200, body
        for app in (second, first, second):
            text, _ = await scrape(app)
            for line in text.splitlines():
                if not line or line[0] == "#":
                    continue
                key, value = line.rsplit(" ", 1)
                if key.split("{", 1)[0].endswith("_total"):
                    assert float(value) >= seen.get(key, 0.0), (key, value, seen.get(key))
                    seen[key] = float(value)
    requests = 'vllm_dp_admin_requests_total{action="reset_prefix_cache",code="200"}'
    await until(lambda: _counted(first, requests, 5), "the five requests in server 0's scrape")


async def _counted(app: PluginApp, key: str, at_least: float) -> bool:
    text, _ = await scrape(app)
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(key)]
    return bool(values) and values[0] >= at_least
