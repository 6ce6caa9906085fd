"""``exporter.remote``'s ``watch()`` against the real service (simulated engines on real ZMQ,
real HTTP on loopback): the snapshot and each change arrive typed, a frozen rank shows as hung;
after the server drops the connection the watch resumes with ``Last-Event-ID`` (no snapshot,
nothing missed), after a real restart it follows the new run's snapshot; a 503 (the watcher
limit) is waited out or, bounded, raised; the sync client; the plugin's ``/dp`` prefix; TLS and
basic auth as every read route."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from exporter.base.ports import free_listen_port
from exporter.feed.hub import WatchHub
from exporter.remote import (
    AuthError,
    BasicAuth,
    Client,
    Credentials,
    Reconnect,
    Reconnecting,
    Secret,
    SyncClient,
    Unreachable,
    Watch,
    WatchEvent,
    WatchRefused,
)
from tests.harness.plugin_app import PluginApps, plugin_env
from tests.harness.secure import SecureFleets
from tests.harness.service import ServiceFactory
from tests.harness.tls import PASSWORD, USER, Pki, write_web_config
from tests.harness.waiting import eventually

#: The longest a test waits for one event (a hung rank: hung_after plus a poll or two).
EVENT_WAIT_S = 10.0
HUNG_AFTER_S = 0.8
QUICK = Reconnect(backoff_s=0.05, max_backoff_s=0.3, max_retry_after_s=0.2)
Predicate = Callable[[WatchEvent], bool]


async def until(watch: Watch, predicate: Predicate, what: str) -> list[WatchEvent]:
    """Every event up to and including the first for which ``predicate`` holds (bounded)."""
    seen: list[WatchEvent] = []

    async def read() -> list[WatchEvent]:
        async for event in watch:
            seen.append(event)
            if predicate(event):
                return seen
        raise AssertionError(f"the watch ended before {what}")

    try:
        return await asyncio.wait_for(read(), EVENT_WAIT_S)
    except asyncio.TimeoutError:
        kinds = [(e.kind, e.engine, e.state) for e in seen]
        raise AssertionError(f"no {what} within {EVENT_WAIT_S}s; saw {kinds}") from None


async def snapshot(watch: Watch, ranks: int) -> list[WatchEvent]:
    """A fresh snapshot's events (its head, then one per rank), checked for their order."""
    head = (await until(watch, lambda e: True, "the snapshot"))[0]
    assert head.kind == "snapshot", head
    rows = [(await until(watch, lambda e: True, "a rank"))[0] for _ in range(ranks)]
    assert [r.kind for r in rows] == ["rank"] * ranks
    assert [r.engine for r in rows] == head.data["engines"]
    return [head, *rows]


def rank(engine: str, **fields: object) -> Predicate:
    return lambda e: e.engine == engine and all(e.data.get(k) == v for k, v in fields.items())


@asynccontextmanager
async def watching(url: str, **kwargs: object) -> AsyncIterator[tuple[Watch, list[Reconnecting]]]:
    notices: list[Reconnecting] = []
    async with Client(url, None) as client:
        reconnect = kwargs.pop("reconnect", QUICK)
        assert isinstance(reconnect, Reconnect)
        async with client.watch(reconnect=reconnect, on_reconnect=notices.append) as watch:
            yield watch, notices


def drop_all(hub: WatchHub) -> int:
    """The server drops every watcher, as it drops one that reads too slowly."""
    watchers = list(hub.watchers)
    for watcher in watchers:
        hub.drop(watcher)
    return len(watchers)


async def test_the_snapshot_then_a_frozen_rank_shown_hung_then_routable_again(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(3, hung_after=HUNG_AFTER_S, gate_min_interval=0.0)
    async with watching(svc.url) as (watch, notices):
        head, *rows = await snapshot(watch, 3)
        assert head.data["reason"] == "connect" and head.data["engines"] == ["0", "1", "2"]
        epoch, seq = rows[-1].id.split("-")
        assert [e.id for e in (head, *rows[:-1])] == [f"{epoch}-{seq}.{k}" for k in range(3)]
        assert all(r.routable and r.state == "awake" for r in rows)
        svc.engines[1].options.frozen = True  # as SIGSTOP leaves an engine
        hung = (await until(watch, rank("1", hung=True), "rank 1 hung"))[-1]
        assert hung.kind == "rank" and hung.routable is False and hung.state == "hung"
        assert any(r.startswith("hung:") for r in hung.reasons), hung.reasons
        assert int(hung.id.split("-")[1]) > int(seq) and watch.last_event_id == hung.id
        svc.engines[1].options.frozen = False
        back = (await until(watch, rank("1", routable=True), "rank 1 routable again"))[-1]
        assert back.state == "awake"
    assert notices == [] and watch.connections == 1


async def test_after_the_server_drops_it_the_watch_resumes_without_a_snapshot(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    hub = svc.exporter.feed
    async with watching(svc.url) as (watch, notices):
        last = (await snapshot(watch, 2))[-1].id
        reading = asyncio.ensure_future(until(watch, rank("1", state="paused"), "rank 1 paused"))
        assert drop_all(hub) == 1
        # The client comes back by itself with its last id: the hub answers a resume.
        await eventually(
            lambda: [w.start for w in hub.watchers] == ["resume"], EVENT_WAIT_S, "the resume"
        )
        svc.engines[1].state.paused = True  # a change made after the reconnect
        after = await reading
        assert [e.kind for e in after] == ["rank"] * len(after), "a resume sends no snapshot"
        assert int(after[0].id.split("-")[1]) == int(last.split("-")[1]) + 1, "nothing missed"
    assert watch.connections == 2 and hub.counts.dropped == 1
    [notice] = notices
    assert isinstance(notice.error, Unreachable) and notice.failures == 0
    assert notice.last_event_id == last


async def test_changes_made_while_it_was_away_are_sent_on_the_resume(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    hub = svc.exporter.feed
    slow = Reconnect(backoff_s=1.5, max_backoff_s=1.5)
    async with watching(svc.url, reconnect=slow) as (watch, notices):
        await snapshot(watch, 2)
        drop_all(hub)
        svc.engines[0].state.paused = True  # while the client is away
        await eventually(
            lambda: svc.exporter.poller.snapshot.engines[0].state == "paused",
            what="rank 0 paused",
        )
        after = await until(watch, rank("0", state="paused"), "rank 0 paused")
        assert [e.kind for e in after] == ["rank"] * len(after)
    assert [n.delay_s for n in notices] == [1.5]


async def test_a_restarted_exporter_is_followed_from_its_new_snapshot() -> None:
    """The service as ``serve`` runs it, on a fixed port: stopped, then started again."""
    listen = f"127.0.0.1:{free_listen_port()}"
    fleets = SecureFleets()  # ``start_service`` on the configured address (no TLS here)
    try:
        first = await fleets.build(2, listen=listen)
        async with watching(first.url) as (watch, notices):
            await snapshot(watch, 2)
            old_epoch = first.running.exporter.feed.epoch
            fleets.made.remove(first)
            await first.stop()
            second = await fleets.build(2, listen=listen)
            assert second.url == first.url
            head = (await until(watch, lambda e: e.kind == "snapshot", "the new snapshot"))[-1]
            assert head.data["reason"] == "restarted" and head.data["epoch"] != old_epoch
            assert head.data["epoch"] == second.running.exporter.feed.epoch
            await until(watch, rank("1", state="awake"), "rank 1 of the new run")
    finally:
        await fleets.close()
    assert notices and all(isinstance(n.error, Unreachable) for n in notices)
    assert all(n.delay_s <= QUICK.max_backoff_s for n in notices)


async def test_the_watcher_limit_is_waited_out_then_bounded(fleet: ServiceFactory) -> None:
    svc = await fleet(1, max_watchers=1)
    hub = svc.exporter.feed
    hub.heartbeat_s = 0.3  # the server sees a client gone at its next write: a heartbeat
    async with watching(svc.url) as (holder, _):
        await snapshot(holder, 1)
        async with watching(svc.url) as (waiter, notices):
            reading = asyncio.ensure_future(until(waiter, lambda e: True, "a first event"))
            await eventually(lambda: len(notices) >= 2, EVENT_WAIT_S, "two refusals")
            await holder.aclose()  # its slot frees: the waiting watch gets in
            assert (await asyncio.wait_for(reading, EVENT_WAIT_S))[0].kind == "snapshot"
    assert all(isinstance(n.error, WatchRefused) for n in notices)
    # Retry-After is 5: capped, or the backoff when that has grown longer.
    cap = QUICK.max_retry_after_s
    assert [n.delay_s for n in notices] == [max(cap, QUICK.delay_s(n.failures)) for n in notices]
    assert hub.counts.refused == len(notices)

    svc = await fleet(1, max_watchers=0)
    started = time.monotonic()
    bounded = Reconnect(max_failures=2, backoff_s=0.05, max_retry_after_s=0.1)
    async with watching(svc.url, reconnect=bounded) as (watch, notices):
        with pytest.raises(WatchRefused, match="at most 0 watchers") as refused:
            await until(watch, lambda e: True, "an event")
    assert refused.value.status == 503 and refused.value.retry_after == 5.0
    assert "gave up after 3 failed attempts" in str(refused.value)
    assert svc.exporter.feed.counts.refused == 3 and len(notices) == 2
    assert 0.2 <= time.monotonic() - started < EVENT_WAIT_S


def follow_in_a_thread(
    url: str, loop: asyncio.AbstractEventLoop, then: Callable[[], object]
) -> tuple[list[tuple[str, str | None]], int]:
    """A training script's thread: the snapshot, then ``then`` (in the service's loop), then
    every event until rank 0 shows paused."""
    seen: list[tuple[str, str | None]] = []
    with SyncClient(url, None) as dp, dp.watch(reconnect=QUICK) as events:
        for event in events:
            seen.append((event.kind, event.engine))
            if len(seen) == 3:
                loop.call_soon_threadsafe(then)
            if event.engine == "0" and event.state == "paused":
                break
        return seen, events.watch.connections


async def test_the_sync_client_follows_and_resumes_from_a_thread(fleet: ServiceFactory) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    hub = svc.exporter.feed

    def drop_then_pause() -> None:
        assert drop_all(hub) == 1
        svc.engines[0].state.paused = True

    loop = asyncio.get_running_loop()
    follow = asyncio.to_thread(follow_in_a_thread, svc.url, loop, drop_then_pause)
    seen, connections = await asyncio.wait_for(follow, 30)
    assert seen[:3] == [("snapshot", None), ("rank", "0"), ("rank", "1")]
    assert ("snapshot", None) not in seen[3:], "the resume sent a snapshot"
    assert seen[-1] == ("rank", "0") and connections == 2 and hub.counts.dropped == 1


async def test_the_plugin_s_feed_under_its_dp_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin_env(monkeypatch)
    apps = PluginApps()
    try:
        app = await apps(2)
        assert app.runtime.exporter is not None and app.fleet is not None
        hub = app.runtime.exporter.feed
        async with watching(app.url + "/dp") as (watch, notices):
            await snapshot(watch, 2)
            reading = asyncio.ensure_future(until(watch, rank("0", paused=True), "rank 0 paused"))
            drop_all(hub)  # the plugin ends the response: the client resumes
            await eventually(
                lambda: [w.start for w in hub.watchers] == ["resume"], EVENT_WAIT_S, "the resume"
            )
            app.fleet.engines[0].state.paused = True
            after = await reading
            assert [e.kind for e in after] == ["rank"] * len(after)
        assert len(notices) == 1 and watch.connections == 2
    finally:
        await apps.close()


@pytest.mark.slow  # the certificates come from the openssl CLI
async def test_tls_and_basic_auth_as_every_read_route(pki: Pki) -> None:
    fleets = SecureFleets()
    try:
        config = write_web_config(pki.dir / "watch.yml", pki, users={USER: PASSWORD})
        secure = await fleets.build(2, web_config_file=str(config))
        good = Credentials(basic_auth=BasicAuth(USER, Secret(PASSWORD)), ca_file=str(pki.ca_cert))
        async with Client(secure.url, None, credentials=good) as client:
            async with client.watch() as watch:
                await snapshot(watch, 2)
        bad = Credentials(basic_auth=BasicAuth(USER, Secret("nope")), ca_file=str(pki.ca_cert))
        notices: list[Reconnecting] = []
        async with Client(secure.url, None, credentials=bad) as client:
            with pytest.raises(AuthError, match="HTTP 401"):
                async with client.watch(on_reconnect=notices.append) as watch:
                    await until(watch, lambda e: True, "an event")
        assert notices == [], "a 401 was retried"
    finally:
        await fleets.close()
