"""Case 7: bounded request bodies, header and keep-alive deadlines (exporter.httpguard),
a scrape storm that does not starve the poller, and rate-limited, audited admin abuse."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from exporter.sim.options import SimOptions
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, RESET_PATH, create_admin_app
from exporter.web.httpguard import guarded_runner
from tests.harness.processes import ROOT
from tests.harness.service import ServiceFactory

TOKEN = "s3cret-admin-token"


async def test_an_oversized_admin_body_is_refused(service_factory: ServiceFactory) -> None:
    svc = await service_factory(2)
    await svc.start_engines()
    await svc.ready()
    assert svc.admin_url is not None
    url = svc.admin_url + RESET_PATH
    async with svc.session.post(url, data=b"x" * (1024 * 1024)) as resp:
        assert resp.status == 413
    # The server is fine afterwards: a normal reset and a scrape work.
    async with svc.session.post(url) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["success"] is True
    families = await svc.scrape()
    assert "vllm_dp_engine_up" in families


async def _hello_app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/", hello)
    return app


async def _read_until_closed(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """Read until EOF (or reset); returns what was read and when the close came."""
    started = time.monotonic()
    data = b""
    try:
        while True:
            chunk = await asyncio.wait_for(reader.read(4096), limit_s)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return data, time.monotonic() - started


async def test_slow_headers_close_at_the_deadline_and_idle_keepalives_at_their_timeout() -> None:
    """Half a request line, a slow drip, and a half-sent second request on a kept-alive
    connection are all cut within their deadline; complete requests are served."""
    header_timeout, keepalive_timeout = 0.5, 1.0
    runner = guarded_runner(
        await _hello_app(),
        header_timeout_s=header_timeout,
        keepalive_timeout_s=keepalive_timeout,
        access_log=None,
        shutdown_timeout=0.5,
    )
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    writers: list[asyncio.StreamWriter] = []
    try:
        # 1. Half a request line, then silence: closed at the header deadline, long before
        #    aiohttp's own keep-alive would have acted (that is 2 x header_timeout here).
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(b"GET /metr")
        await writer.drain()
        data, took = await _read_until_closed(reader, 5)
        assert data == b"" and took < header_timeout + 0.4, took

        # 2. A slow drip (a byte every 0.1 s) does not extend the deadline.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        started = time.monotonic()

        async def drip() -> None:
            for byte in b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: 1":
                writer.write(bytes([byte]))
                await asyncio.sleep(0.1)

        dripping = asyncio.create_task(drip())
        data, _ = await _read_until_closed(reader, 5)
        took = time.monotonic() - started
        dripping.cancel()
        assert data == b"" and took < header_timeout + 0.4, took

        # 3. A complete request is served; a half-sent second request on the kept-alive
        #    connection is cut within the keep-alive timeout.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert head.startswith(b"HTTP/1.1 200")
        body = await asyncio.wait_for(reader.readexactly(2), 2)
        assert body == b"hi"
        answered = time.monotonic()
        writer.write(b"GET / HT")
        await writer.drain()
        data, _ = await _read_until_closed(reader, 5)
        assert data == b"" and time.monotonic() - answered < keepalive_timeout + 0.6

        # 4. Ordinary clients are unaffected.
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.get(f"http://127.0.0.1:{port}/") as resp:
                    assert resp.status == 200 and await resp.text() == "hi"
        assert runner.header_deadline is not None
        assert runner.header_deadline.closed_connections == 2
        assert runner.header_deadline.watched == 0
    finally:
        for w in writers:
            w.close()
        await runner.cleanup()


STORM_SCRIPT = """
import asyncio, sys
sys.path.insert(0, ".")
from tests.integration.resilience.test_http_side import _storm
statuses, rounds = asyncio.run(_storm(sys.argv[1], float(sys.argv[2])))
print(statuses[200], rounds)
"""


async def _storm(url: str, duration_s: float) -> tuple[Counter[int], int]:
    """300 concurrent GET /metrics, round after round, for ``duration_s``."""
    statuses: Counter[int] = Counter()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def scrape() -> None:
            async with session.get(url, headers={"Accept-Encoding": "gzip"}) as resp:
                await resp.read()
                statuses[resp.status] += 1

        started = time.monotonic()
        rounds = 0
        while time.monotonic() - started < duration_s:
            await asyncio.gather(*(scrape() for _ in range(300)))
            rounds += 1
    return statuses, rounds


@pytest.mark.slow
async def test_a_scrape_storm_does_not_starve_the_poller(
    service_factory: ServiceFactory,
) -> None:
    interval, call_timeout = 0.1, 0.5
    svc = await service_factory(
        2, guarded=True, poll_interval=interval, poll_jitter=0.0, call_timeout=call_timeout
    )
    await svc.start_engines()
    await svc.ready()
    poller = svc.exporter.poller
    seen: list[tuple[int, float]] = []
    stop = asyncio.Event()

    async def watch() -> None:
        while not stop.is_set():
            n = poller.snapshot.poll_number
            if not seen or seen[-1][0] != n:
                seen.append((n, time.monotonic()))
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    # The storm comes from another process (as real scrapers do): the exporter's loop only
    # does the server side of it.
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        STORM_SCRIPT,
        svc.url + "/metrics",
        "1.5",
        stdout=asyncio.subprocess.PIPE,
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    ok, rounds = (int(x) for x in out.split())
    statuses = Counter({200: ok})
    storm_s = time.monotonic() - started
    stop.set()
    await watcher
    assert statuses == Counter({200: 300 * rounds})
    during = [t for _, t in seen if t <= started + storm_s]
    gaps = [b - a for a, b in itertools.pairwise(during)]
    # The poller keeps its cadence through the storm: a poll starts at most one interval after
    # the previous one ended and takes at most the call timeout, so no gap may exceed their sum
    # (plus a margin for a loaded CI machine). Scrapes between two polls reuse the cached body
    # (Exporter.render_metrics); without that cache the gaps stretched to ~0.9 s here.
    assert gaps and max(gaps) <= interval + call_timeout + 0.5, gaps
    assert len(during) >= storm_s / (interval + call_timeout + 0.5)
    assert poller.snapshot.ready
    for method in ("is_sleeping", "is_scheduler_paused"):
        for engine in ("0", "1"):
            assert svc.exporter.stats.utility_calls[(method, engine, "timeout")] == 0


async def test_admin_token_abuse_is_rate_limited_and_audited(
    service_factory: ServiceFactory, tmp_path: Any
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    svc = await service_factory(2, admin_listen="off", admin_token_file=str(token_file))
    await svc.start_engines(by_index={0: SimOptions()})
    await svc.ready()
    records: list[dict[str, Any]] = []
    admin = create_admin_app(svc.exporter, audit=records.append)
    runner = web.AppRunner(admin, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}{RESET_PATH}"
    try:
        statuses = []
        for i in range(25):
            headers = {"Authorization": f"Bearer wrong-{i}"}
            async with svc.session.post(url, headers=headers) as resp:
                statuses.append(resp.status)
                if resp.status == 429:
                    assert int(resp.headers["Retry-After"]) >= 1
        assert statuses[:5] == [401] * 5 and statuses[5:] == [429] * 20, statuses
        assert len(records) == 25
        outcomes = Counter(r["outcome"] for r in records)
        assert outcomes == Counter({"unauthorized": 5, "auth_rate_limited": 20})
        assert all(r["status"] in (401, 429) and r["client"] for r in records)
        assert not any("wrong-" in repr(r) or TOKEN in repr(r) for r in records), "tokens leak"
        # No engine was called by any of it.
        assert all(e.calls_by_method.get("reset_prefix_cache", 0) == 0 for e in svc.engines)
    finally:
        await admin[ADMIN_SHUTDOWN_KEY]()
        await runner.cleanup()
