"""vLLM 0.34's checkpoint lifecycle inside vLLM's API server (the plugin on real uvicorn over a
simulated ``AsyncLLM`` whose 0.34 engines are real ZMQ peers): each rank's state polled, the
plugin's gate, and ``POST /dp/admin/checkpoint/prepare`` (vLLM's route name) verified."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from exporter.sim.options import SimOptions
from tests.harness.inprocess import ADMIN_TOKEN, token_file
from tests.harness.plugin_app import PluginApps
from tests.harness.waiting import eventually


async def test_a_snapshot_through_the_plugin(
    plugin_apps: PluginApps, env: Callable[..., None], tmp_path: Path
) -> None:
    env(ADMIN_TOKEN_FILE=token_file(tmp_path), GATE_MIN_INTERVAL="0")
    app = await plugin_apps(3, options=SimOptions(vllm_version="0.34.0"))
    exporter = app.runtime.exporter
    assert exporter is not None
    await eventually(
        lambda: exporter.poller.snapshot.verdicts["checkpoint_state"].value == ["running", None],
        what="every rank running",
    )
    prepare = await app.post("checkpoint/prepare", token=ADMIN_TOKEN, params={"mode": "abort"})
    assert prepare[0] == 200, prepare[1]
    assert [e["state"][0] for e in prepare[1]["engines"]] == ["prepared"] * 3
    code, body = await app.get_json("/dp/gate?checkpoint=prepared")
    assert code == 200, body
    restore = await app.post("checkpoint_restore", token=ADMIN_TOKEN)
    assert restore[0] == 200, restore[1]
    assert (await app.get_json("/dp/gate?checkpoint=running"))[0] == 200
