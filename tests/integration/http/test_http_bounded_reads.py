"""HTTP mode reads every answer from a target up to a fixed limit (docs/reliability.md, E2):
a body that never ends, one over the limit, one that drips a byte at a time — from a plain
target's dev routes or a plugin target's ``/dp/gate``, first, middle or last — is that
target's failure for the poll (``failed`` naming the limit, or ``timeout``), its connection
dropped; the target is
asked again next poll, the exporter's memory stays bounded and ``/metrics`` and ``/status`` keep
answering. Real sockets both ways: a hostile aiohttp server (``tests/harness/hostile_api.py``)
and the exporter served over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.client import HttpFleetClient, HttpTarget
from exporter.client.http.routes import MAX_ANSWER, MAX_CHECKSUM_ANSWER
from tests.harness.hostile_api import HostileApi, gate_doc, plain_good, sidecar_over
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import Service

POSITIONS = {"first": 0, "middle": 1, "last": 2}
CALL_TIMEOUT = 0.5
#: What one hostile answer may have sent before the exporter stopped reading it: the limit, plus
#: what loopback sockets buffer on both sides (without the fix: the whole stream, 256 MiB).
SENT_CAP = MAX_ANSWER + (20 << 20)
#: The exporter's growth while a target streams at it (without the fix: gigabytes).
RSS_CAP = 256 << 20
TOO_LONG = "longer than 4 MiB"


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextlib.asynccontextmanager
async def fleet(
    position: int, hostile: Callable[[HostileApi], None], *, plugin: bool
) -> AsyncIterator[tuple[Service, HostileApi]]:
    """An exporter over three targets ``t0..t2`` (plain, or plugin targets naming ranks 0 and
    1); the one at ``position`` is set up by ``hostile``."""

    def setup(i: int, api: HostileApi) -> None:
        if plugin:
            api.json("/dp/gate", gate_doc([0, 1]))
        else:
            plain_good(api)
        if i == position:
            hostile(api)

    async with sidecar_over(setup, plugin=plugin, poll_interval=0.1, call_timeout=CALL_TIMEOUT) as (
        service,
        apis,
    ):
        yield service, apis[position]


async def sleeping_of(run: Service) -> dict[str, dict[str, Any]]:
    """Each engine's ``is_sleeping`` in ``/status`` (answered within a few seconds)."""
    doc = await asyncio.wait_for(run.status(), 4)
    return {e["engine"]: e["invariants"]["is_sleeping"] for e in doc["engines"]}


async def still_serving(run: Service, polls: int = 3) -> str:
    """Polls go on and ``/metrics`` and ``/status`` answer within a few seconds; the last
    scrape."""
    text = ""
    for _ in range(polls):
        await run.fresh_poll()
        text = await asyncio.wait_for(run.metrics(), 4)
        await sleeping_of(run)
    return text


def others_ok(found: dict[str, dict[str, Any]], hostile: str) -> bool:
    return all(o["outcome"] == "ok" for label, o in found.items() if label != hostile)


def endless(path: str) -> Callable[[HostileApi], None]:
    return lambda api: api.endless(path)


def over_limit(path: str, doc: dict[str, Any]) -> Callable[[HostileApi], None]:
    return lambda api: api.padded(path, doc, MAX_ANSWER + 4096)


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", ["endless", "over_limit"])
async def test_a_dev_route_answer_past_the_limit_is_a_failed_call(kind: str, position: str) -> None:
    path = "/is_sleeping"
    hostile = endless(path) if kind == "endless" else over_limit(path, {"is_sleeping": False})
    label = f"t{POSITIONS[position]}"
    async with fleet(POSITIONS[position], hostile, plugin=False) as (run, api):
        before = rss_bytes()
        failed: dict[str, dict[str, Any]] = {}

        async def refused() -> bool:
            failed.clear()
            failed.update(await sleeping_of(run))
            o = failed[label]
            return o["outcome"] == "failed" and TOO_LONG in (o["error"] or "")

        await eventually_async(refused, f"{label}'s answer refused")
        assert others_ok(failed, label), failed
        families = parse_metrics(await still_serving(run))
        calls = metric_value(
            families, "vllm_dp_utility_calls", method="is_sleeping", engine=label, outcome="failed"
        )
        assert calls is not None and calls >= 2
        assert api.asked[path] >= 3  # asked again every poll
        assert max(api.streamed.get(path, [0])) < SENT_CAP
        # Never reused: each answer over the limit closed its connection.
        ports = api.ports[path]
        assert len(set(ports)) == len(ports), ports
        assert rss_bytes() - before < RSS_CAP


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", ["endless", "over_limit", "drip"])
async def test_a_plugin_gate_answer_past_the_limit_or_too_slow_is_that_targets_failure(
    kind: str, position: str
) -> None:
    path = "/dp/gate"
    hostile = {
        "endless": endless(path),
        "over_limit": over_limit(path, gate_doc([0, 1])),
        "drip": lambda api: api.drip(path),
    }[kind]
    label = f"t{POSITIONS[position]}"  # it never named its ranks: one engine, the target
    want = ("timeout", "") if kind == "drip" else ("failed", TOO_LONG)
    async with fleet(POSITIONS[position], hostile, plugin=True) as (run, api):
        before = rss_bytes()
        found: dict[str, dict[str, Any]] = {}

        async def settled() -> bool:
            found.clear()
            found.update(await sleeping_of(run))
            o = found.get(label)
            if o is None or o["outcome"] != want[0] or want[1] not in (o["error"] or ""):
                return False
            return others_ok(found, label) and len(found) == 5  # t0..t2's other ranks named

        await eventually_async(settled, f"{label} {want[0]}, the other targets' ranks ok")
        # Asked again, not once for good: a hung read is abandoned after two deadlines.
        await eventually_async(lambda: api.asked[path] >= 3, f"{path} asked again", 15)
        families = parse_metrics(await still_serving(run))
        assert metric_value(families, "vllm_dp_engine_up", engine=label) == 0.0
        assert max(api.streamed.get(path, [0])) < SENT_CAP
        if kind != "over_limit":  # a stream the exporter stopped reading: its connection closed
            await eventually_async(lambda: api.abandoned[path] >= 1, "a dropped connection")
        assert rss_bytes() - before < RSS_CAP


async def eventually_async(
    predicate: Callable[[], Any], what: str, timeout_s: float = 10.0
) -> None:
    """Wait (bounded) until ``predicate()`` (awaited when it is a coroutine) is true."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def holds() -> bool:
        found = predicate()
        return bool(await found if inspect.isawaitable(found) else found)

    while not await holds():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.05)


def checksums_of(size: int) -> dict[str, str]:
    """A ``/weight_checker`` map of about ``size`` bytes (two workers' tensors)."""
    entries = size // 110
    return {
        f"dp0:pp0:pcp0:tp{i % 2}:ep0:model.layers.{i}.mlp.weight": f"{i:064x}"
        for i in range(entries)
    }


async def test_each_answer_is_read_up_to_its_documented_limit(
    clients: list[HttpFleetClient],
) -> None:
    """A dev route's answer of exactly ``MAX_ANSWER`` bytes is read, one byte more refused; a
    large model's weight checksums (several MiB) are read whole, up to ``MAX_CHECKSUM_ANSWER``."""
    api = plain_good(await HostileApi().start())
    try:
        client = HttpFleetClient([HttpTarget("a", api.url)])
        await client.start()
        clients.append(client)

        async def call(method: str) -> Any:
            (outcome,) = await client.call_utility(method, timeout_s=20)
            return outcome

        api.padded("/is_sleeping", {"is_sleeping": True}, MAX_ANSWER)
        assert (await call("is_sleeping")).value is True
        api.padded("/is_sleeping", {"is_sleeping": True}, MAX_ANSWER + 1)
        refused = await call("is_sleeping")
        assert refused.outcome is Outcome.FAILED and TOO_LONG in (refused.error or "")
        assert "/is_sleeping" in (refused.error or "")

        large = checksums_of(6 << 20)
        api.json("/weight_checker", {"checksums": large})
        ok = await call("compute_weight_checksums")
        assert ok.outcome is Outcome.OK, ok.error
        assert sum(len(worker) for worker in ok.value) == len(large)
        api.padded("/weight_checker", {"checksums": {}}, MAX_CHECKSUM_ANSWER + 1)
        refused = await call("compute_weight_checksums")
        assert refused.outcome is Outcome.FAILED
        assert "longer than 32 MiB" in (refused.error or ""), refused.error
        # The client goes on: the next call on this target answers.
        api.json("/is_sleeping", {"is_sleeping": False})
        assert (await call("is_sleeping")).value is False
    finally:
        await api.close()
