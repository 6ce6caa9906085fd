"""``GET /watch`` over real HTTP against the service with simulated engines on real ZMQ:
a snapshot then each change with ids, a frozen rank at the first, middle and last position
sent hung then routable again, resume with ``Last-Event-ID``, heartbeats, hostile ids, the
watcher limit (503, counted), a reader that never reads dropped without growing the exporter,
and basic auth over TLS as every read route."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import ssl
from collections.abc import AsyncGenerator
from pathlib import Path

import aiohttp
import pytest

from tests.harness.scrape import metric_value
from tests.harness.secure import SecureFleets
from tests.harness.service import Service, ServiceFactory
from tests.harness.sse import EventReader
from tests.harness.tls import Pki, make_pki, write_web_config
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
HUNG_AFTER_S = 0.8


async def open_watch(
    svc: Service, headers: dict[str, str] | None = None
) -> tuple[aiohttp.ClientResponse, EventReader]:
    resp = await svc.session.get(svc.url + "/watch", headers=headers or {})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return resp, EventReader(resp)


async def snapshot_of(reader: EventReader, ranks: int) -> list[str]:
    """The ids of a fresh snapshot's events, checked for their order."""
    head = await reader.next()
    assert head.event == "snapshot"
    rows = [await reader.next() for _ in range(ranks)]
    assert [r.event for r in rows] == ["rank"] * ranks
    assert [r.data["engine"] for r in rows] == head.data["engines"]
    return [head.id, *(r.id for r in rows)]


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_frozen_rank_is_sent_hung_then_routable_again(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(3, hung_after=HUNG_AFTER_S, gate_min_interval=0.0)
    resp, reader = await open_watch(fleet)
    async with resp:
        ids = await snapshot_of(reader, 3)
        epoch, seq = ids[-1].split("-")
        assert ids[:-1] == [f"{epoch}-{seq}.{k}" for k in range(3)]
        me = str(position)
        fleet.engines[position].options.frozen = True  # as SIGSTOP leaves an engine
        hung = await reader.until(lambda e: e.data.get("engine") == me and e.data["hung"])
        assert hung.event == "rank" and not hung.data["routable"]
        assert any(r.startswith("hung:") for r in hung.data["reasons"])
        assert int(hung.id.split("-")[1]) > int(seq)
        fleet.engines[position].options.frozen = False
        back = await reader.until(lambda e: e.data.get("engine") == me and e.data["routable"])
        assert back.data["state"] == "awake" and int(back.id.split("-")[1]) > int(
            hung.id.split("-")[1]
        )


async def test_resume_sends_what_was_missed_and_heartbeats_carry_the_last_id(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    fleet.exporter.feed.heartbeat_s = 0.3
    resp, reader = await open_watch(fleet)
    async with resp:
        last = (await snapshot_of(reader, 3))[-1]
        beat = await reader.next_of("heartbeat")
        assert beat.id == last
    # While nobody watches, rank 1 is paused: the change is kept for a resume.
    fleet.engines[1].state.paused = True
    await eventually(
        lambda: fleet.exporter.poller.snapshot.engines[1].state == "paused", what="rank 1 paused"
    )
    resp, reader = await open_watch(fleet, {"Last-Event-ID": last})
    async with resp:
        first = await reader.next()
        assert first.event == "rank", "a resume starts with the changes, not a snapshot"
        paused = (
            first
            if first.data["engine"] == "1"
            else await reader.until(lambda e: e.data.get("engine") == "1")
        )
        assert paused.data["state"] == "paused" and not paused.data["routable"]
    # The same id as a query parameter (clients that cannot set the header).
    async with fleet.session.get(fleet.url + f"/watch?last_event_id={paused.id}") as resp:
        reader = EventReader(resp)
        assert (await reader.next(timeout_s=3)).event == "heartbeat"


@pytest.mark.parametrize(
    "hostile",
    ["x" * 8000, "ffffffff-1", "\u00e9t\u00e9-1", "1-²", "abcd-99999999999999999999"],
    ids=["long", "other-run", "non-ascii", "superscript", "huge"],
)
async def test_a_hostile_last_event_id_gets_a_fresh_snapshot(
    fleet_factory: ServiceFactory, hostile: str
) -> None:
    fleet = await fleet_factory(2, gate_min_interval=0.0)
    headers = {"Last-Event-ID": hostile.encode("utf-8").decode("latin-1")}
    resp, reader = await open_watch(fleet, headers)
    async with resp:
        head = await reader.next()
        assert head.event == "snapshot" and head.data["reason"] in ("unknown_id", "restarted")
    assert (await fleet.get_json("/status"))[0] == 200  # still serving


async def test_beyond_max_watchers_is_a_503_and_counted(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1, max_watchers=1)
    resp, reader = await open_watch(fleet)
    async with resp:
        await reader.next()
        async with fleet.session.get(fleet.url + "/watch") as refused:
            assert refused.status == 503 and "Retry-After" in refused.headers
            assert "--max-watchers" in (await refused.json())["error"]
        m = await fleet.scrape()
        assert metric_value(m, "vllm_dp_watch_refused_total") == 1.0
        assert metric_value(m, "vllm_dp_watchers") == 1.0
    await eventually(lambda: not fleet.exporter.feed.watchers, what="the slot released")
    resp, reader = await open_watch(fleet)
    async with resp:
        assert (await reader.next()).event == "snapshot"


async def silent_reader(url: str) -> AsyncGenerator[asyncio.StreamWriter, None]:
    """A client that asks for the feed and never reads a byte."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /watch HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    yield writer
    writer.close()


async def test_a_reader_that_never_reads_is_dropped_and_the_others_keep_up(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(2, gate_min_interval=0.0)
    hub = fleet.exporter.feed
    resp, reader = await open_watch(fleet)
    async with resp:
        await snapshot_of(reader, 2)
        silent = silent_reader(fleet.url)
        await silent.__anext__()
        await eventually(lambda: len(hub.watchers) == 2, what="both watchers connected")
        poller = fleet.exporter.poller
        received = 0

        async def read_all() -> None:
            nonlocal received
            while True:
                await reader.next()
                received += 1

        reading = asyncio.create_task(read_all())
        try:
            # Changes as fast as the loop turns (each one a whole row, ~0.5 KB): the silent
            # reader's socket fills, then its queue; the reading one keeps up.
            snap = poller.snapshot
            first, *rest = snap.engines
            for _turn in range(50_000):  # ~50 MB of rows: past any loopback buffer
                for hung in (True, False):
                    engines = (dataclasses.replace(first, hung=hung), *rest)
                    hub.publish(dataclasses.replace(snap, engines=engines))
                await asyncio.sleep(0)
                if hub.counts.dropped:
                    break
            assert hub.counts.dropped == 1, "the silent reader was never dropped"
            assert len(hub.watchers) == 1
            assert all(len(w.frames) <= w.limit for w in hub.watchers)
        finally:
            reading.cancel()
        assert received > 2
        m = await fleet.scrape()
        assert metric_value(m, "vllm_dp_watch_dropped_total") == 1.0
        await silent.aclose()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


async def test_basic_auth_and_tls_as_every_read_route(pki: Pki, tmp_path: Path) -> None:
    fleets = SecureFleets()
    try:
        config = write_web_config(pki.dir / "watch.yml", pki, users={"ops": "s3cret"})
        fleet = await fleets.build(2, web_config_file=str(config))
        tls = ssl.create_default_context(cafile=str(pki.ca_cert))
        async with aiohttp.ClientSession() as session:
            async with session.get(fleet.url + "/watch", ssl=tls) as resp:
                assert resp.status == 401
            auth = {"Authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
            async with session.get(fleet.url + "/watch", ssl=tls, headers=auth) as resp:
                assert resp.status == 200
                head = await EventReader(resp).next()
                assert head.event == "snapshot" and head.data["engines"] == ["0", "1"]
                assert json.dumps(head.data)
    finally:
        await fleets.close()


async def test_a_client_that_leaves_frees_its_slot_within_seconds(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(1, max_watchers=1)  # heartbeats every 5 s: not what frees it
    resp, reader = await open_watch(fleet)
    await reader.next()
    resp.close()
    await eventually(lambda: not fleet.exporter.feed.watchers, 3, "the slot freed")
    resp, reader = await open_watch(fleet)
    async with resp:
        assert (await reader.next()).event == "snapshot"
