"""``GET /dp/watch`` inside vLLM's API server (the plugin on real uvicorn over a simulated
``AsyncLLM`` whose engines are real ZMQ peers): the same feed as the service's — a snapshot,
a frozen rank at the first, middle and last position sent hung and then routable again, a
resume, the watcher limit — and a watcher that leaves frees its slot."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from exporter.feed.hub import WatchHub
from tests.harness.plugin_app import PluginApp, PluginApps, plugin_env
from tests.harness.sse import EventReader
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}


@pytest.fixture
async def plugin_apps() -> AsyncIterator[PluginApps]:
    apps = PluginApps()
    yield apps
    await apps.close()


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    plugin_env(monkeypatch)
    return lambda **settings: plugin_env(monkeypatch, **settings)


def hub_of(app: PluginApp) -> WatchHub:
    exporter = app.runtime.exporter
    assert exporter is not None
    return exporter.feed


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_dp_watch_follows_a_frozen_rank(
    plugin_apps: PluginApps, env: Callable[..., None], position: int
) -> None:
    env(HUNG_AFTER="0.8")
    app = await plugin_apps(3)
    assert app.fleet is not None
    me = str(position)
    async with app.session.get(app.url + "/dp/watch") as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        reader = EventReader(resp)
        head = await reader.next()
        assert head.event == "snapshot" and head.data["engines"] == ["0", "1", "2"]
        rows = [await reader.next() for _ in range(3)]
        assert all(r.data["routable"] for r in rows), rows
        app.fleet.engines[position].options.frozen = True  # as SIGSTOP leaves it
        hung = await reader.until(lambda e: e.data.get("engine") == me and e.data["hung"])
        assert not hung.data["routable"]
        app.fleet.engines[position].options.frozen = False
        back = await reader.until(lambda e: e.data.get("engine") == me and e.data["routable"])
    await eventually(lambda: not hub_of(app).watchers, what="the watcher's slot released")
    # Resume from the last change: no snapshot, nothing missed (a heartbeat at most).
    hub_of(app).heartbeat_s = 0.3
    async with app.session.get(app.url + "/dp/watch", headers={"Last-Event-ID": back.id}) as resp:
        first = await EventReader(resp).next()
        assert first.event in ("heartbeat", "rank") and first.event != "snapshot"


async def test_dp_watch_refuses_beyond_max_watchers(
    plugin_apps: PluginApps, env: Callable[..., None]
) -> None:
    env(MAX_WATCHERS="1")
    app = await plugin_apps(2)
    async with app.session.get(app.url + "/dp/watch") as resp:
        assert (await EventReader(resp).next()).event == "snapshot"
        status, body = await app.get_json("/dp/watch")
        assert status == 503 and "--max-watchers" in body["error"]
    assert hub_of(app).counts.refused == 1
