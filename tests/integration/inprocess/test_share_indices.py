"""With several API servers, only the files of API servers ``0 .. count-1`` are summed.

A file of another index in ``PROMETHEUS_MULTIPROC_DIR`` (a previous run with more API servers,
a stray copy) once made ``vllm_dp_utility_calls_total`` jump by millions for a minute, then
drop: a counter reset to every ``rate()``. The plugin's app (API server 0 of 2) on real uvicorn
and real files: API server 1's file is summed, the stray ones are skipped with one warning each.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from exporter.inprocess.shared import ProcessShare
from tests.harness.plugin_app import PluginApp, plugin_env, start_with_fleet, vllm_series
from tests.harness.scrape import metric_value, parse_metrics

CALLS = {"method": "is_sleeping", "engine": "0", "outcome": "ok"}
RESETS = {"action": "reset_prefix_cache", "code": "200"}
STRAY = 6_000_000.0


def share(calls: float, resets: float) -> bytes:
    """A believable file of one API server's counters."""
    return json.dumps(
        [
            {
                "name": "vllm_dp_utility_calls_total",
                "labels": ["method", "engine", "outcome"],
                "rows": [[list(CALLS.values()), calls]],
            },
            {
                "name": "vllm_dp_admin_requests_total",
                "labels": ["action", "code"],
                "rows": [[list(RESETS.values()), resets]],
            },
        ]
    ).encode()


@pytest.fixture
async def server_0(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> AsyncIterator[PluginApp]:
    """API server 0 of 2 over two simulated engines, its share directory empty."""
    plugin_env(monkeypatch)
    directory = tmp_path / "prometheus-multiproc"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    with vllm_series():
        app = await start_with_fleet(2, api_server_index=0, api_server_count=2)
        try:
            yield app
        finally:
            await app.stop()


async def test_files_of_api_servers_beyond_the_count_are_not_summed(
    server_0: PluginApp, caplog: pytest.LogCaptureFixture
) -> None:
    share_obj = server_0.runtime.share
    assert share_obj is not None and share_obj.count == 2
    directory = share_obj.directory
    (directory / "vllm_dp_exporter.1.json").write_bytes(share(5, 3))  # API server 1: summed
    strays = ["vllm_dp_exporter.2.json", "vllm_dp_exporter.9999.json"]
    for name in strays:  # index == count, and a large one
        (directory / name).write_bytes(share(STRAY, STRAY))
    (directory / "vllm_dp_exporter.01.json").write_bytes(share(STRAY, STRAY))  # not a name

    with caplog.at_level(logging.WARNING, logger="exporter.inprocess"):
        for _ in range(2):
            families = parse_metrics(await server_0.metrics())
            assert metric_value(families, "vllm_dp_admin_requests", **RESETS) == 3.0
            calls = metric_value(families, "vllm_dp_utility_calls", **CALLS)
            # API server 1's 5 and server 0's own polls (a few), never a stray's millions.
            assert calls is not None and 5.0 <= calls < 10_000, calls
    warned = [r.getMessage() for r in caplog.records if r.name == "exporter.inprocess"]
    for name in strays:
        assert len([m for m in warned if name in m]) == 1, warned
    assert not [m for m in warned if ".01.json" in m or ".1.json" in m], warned


def test_an_index_that_is_not_below_the_count_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not below"):
        ProcessShare(str(tmp_path), 2, list, lambda: 0, count=2)
