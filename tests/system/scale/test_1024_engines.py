"""The flood bound (docs/reliability.md, row A5) and fault isolation (row A1) hold at 1,024
engines (docs/scale.md).

One exporter (owner mode, in this process) expects 1,024 engines; engines 1..1,023 run in one other
process (``tests.system.scale.bulk_engines``: plain pyzmq, cheap enough for a quick test), engine 0
is never started, and a peer floods engine 1's output address. Every engine that runs is polled and
up, only engine 0 is down, ``/metrics`` keeps answering within a bound, the flood is counted and
memory stays bounded. The figures of a longer flood and of polls at 1,024 engines are in ``make
bench`` (docs/benchmarks/README.md) and ``python -m bench.scale`` (docs/scale.md)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.flood import FLOODER
from bench.procs import proc_rss_kib, stop_process
from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import serve_config, start_service
from tests.harness.waiting import eventually

ENGINES = 1024
MISSING = 0  # never started
FLOODED = 1  # a peer floods its output address
FLOOD_S = 3.0
SCRAPE_BOUND_S = 3.0  # generous: a shared 2-core machine; the bench reports real figures
RSS_GROWTH_CAP_MIB = 150.0
ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
async def test_1024_engines_one_missing_one_flooded(tmp_path: Path) -> None:
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    config = serve_config(
        attach="owner",
        engine_count=ENGINES,
        handshake_address=handshake,
        admin_listen="off",
        poll_interval=0.5,
        call_timeout=5.0,
    )
    service = await start_service(config)
    log = open(tmp_path / "engines.log", "wb")  # noqa: SIM115
    engines = subprocess.Popen(
        [sys.executable, "-m", "tests.system.scale.bulk_engines", handshake, "1", str(ENGINES - 1)],
        cwd=ROOT,
        stdout=log,
        stderr=log,
    )
    flooder: subprocess.Popen[bytes] | None = None
    try:
        client = service.client
        await eventually(lambda: connected_count(client) == ENGINES - 1, 60, "1,023 handshakes")
        await service.fresh_poll(30)
        rss_before = proc_rss_kib_self()
        address = client.engine_details()[FLOODED].address
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, address, str(FLOOD_S)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        polls_before = service.exporter.poller.snapshot.poll_number
        scrapes: list[float] = []
        rss_peak = rss_before
        while flooder.poll() is None:
            t0 = time.perf_counter()
            await service.metrics()
            scrapes.append(time.perf_counter() - t0)
            rss_peak = max(rss_peak, proc_rss_kib_self())
            await asyncio.sleep(0.1)
        sent = int((flooder.communicate(timeout=10)[0] or b"0").strip() or 0)
        await service.fresh_poll(30)
        polls = service.exporter.poller.snapshot.poll_number - polls_before
        families = parse_metrics(await service.metrics())
    finally:
        if flooder is not None:
            stop_process(flooder)
        stop_process(engines)
        log.close()
        await service.stop()

    assert sent > 10_000, "the flooder did not flood"
    assert scrapes, "no scrape completed during the flood"
    assert max(scrapes) < SCRAPE_BOUND_S, f"a scrape took {max(scrapes):.2f}s"
    assert polls >= 3, f"only {polls} polls during and after the flood"
    counted = metric_value(families, "vllm_dp_protocol_errors_total", kind="wrong_shape")
    assert counted is not None and counted > 1000, f"flood frames counted: {counted}"
    up = {i: metric_value(families, "vllm_dp_engine_up", engine=str(i)) for i in range(ENGINES)}
    assert up[MISSING] == 0.0
    assert [i for i, v in up.items() if i != MISSING and v != 1.0] == []
    timeouts = [
        i
        for i in range(ENGINES)
        if metric_value(
            families,
            "vllm_dp_utility_calls_total",
            method="is_sleeping",
            engine=str(i),
            outcome="timeout",
        )
    ]
    assert timeouts == [], f"engines timed out: {timeouts[:10]}"
    assert metric_value(families, "vllm_dp_engines_connected") == ENGINES - 1
    growth = (rss_peak - rss_before) / 1024
    assert growth < RSS_GROWTH_CAP_MIB, f"RSS grew {growth:.0f} MiB during the flood"


def proc_rss_kib_self() -> int:
    return proc_rss_kib(os.getpid())
