"""The plugin's per-rank routing answers inside vLLM's API server (docs/activity.md): a frozen
engine (as SIGSTOP leaves it) becomes hung, ``/dp/routable`` and ``/dp/readyz?engine=N`` leave it
out, the others stay routable, and thawed it is routable again. Real uvicorn, real ZMQ."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from tests.harness.plugin_app import PluginApp, PluginApps


async def routable_until(
    app: PluginApp, want: list[str], hung: str | None = None
) -> dict[str, Any]:
    """``/dp/routable`` once it names exactly ``want`` (and engine ``hung`` is hung; bounded:
    10 s)."""
    body: dict[str, Any] = {}
    for _ in range(200):
        status, body = await app.get_json("/dp/routable")
        assert status == 200
        reasons = {e["engine"]: e["reasons"] for e in body["engines"]}
        is_hung = hung is None or any(r.startswith("hung:") for r in reasons[hung])
        if body["routable_engines"] == want and is_hung:
            return body
        await asyncio.sleep(0.05)  # the plugin polls every 0.1 s: a few polls pass
    raise AssertionError(f"/dp/routable never named {want} (hung: {hung}): {body}")


async def test_dp_routable_and_readyz_follow_a_frozen_rank(
    plugin_apps: PluginApps, env: Callable[..., None]
) -> None:
    env(HUNG_AFTER="0.8")
    app = await plugin_apps(3)
    assert app.fleet is not None
    await routable_until(app, ["0", "1", "2"])
    app.fleet.engines[1].options.frozen = True  # as SIGSTOP leaves an engine process
    await routable_until(app, ["0", "2"], hung="1")
    status, answer = await app.get_json("/dp/readyz?engine=1")
    assert status == 503 and not answer["routable"]
    assert (await app.get_json("/dp/readyz?engine=0"))[0] == 200
    assert (await app.get_json("/dp/readyz?engine=9"))[0] == 404
    app.fleet.engines[1].options.frozen = False  # SIGCONT
    await routable_until(app, ["0", "1", "2"])
    assert (await app.get_json("/dp/readyz?engine=1"))[0] == 200
