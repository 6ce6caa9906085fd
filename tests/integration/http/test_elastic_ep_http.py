"""HTTP mode reads each API server's elastic-EP operation from vLLM's ``POST
/is_scaling_elastic_ep``: the full exporter over simulated API servers on loopback (0.33's
answer, 0.32's, the Rust front end's 404 and 501, vLLM's 503, hostile bodies, a route that
hangs), read back through ``/metrics``, ``/status`` and the status page; the polls' utility
reads never wait for it."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from typing import Any

import pytest

from exporter.client.fleet import FleetClient
from exporter.client.http.client import HttpFleetClient
from exporter.client.observe import elastic_ep_reads
from exporter.control.attach import parse_targets
from exporter.protocol.elastic_ep import ELASTIC_EP_PHASES, MAX_ELASTIC_EP_ANSWER, ElasticEpRead
from exporter.remote.status import Status
from exporter.sim.api_elastic import ELASTIC_EP_PATH
from exporter.sim.api_server import sim_of, start_api_server
from tests.harness.apiservers import HOST, ApiServer, StartApi, http_config
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

NAMES = ("first", "middle", "last")
PHASE_FAMILY = "vllm_dp_elastic_ep_operation"
EPOCH_FAMILY = "vllm_dp_elastic_ep_epoch"
SIZE_FAMILY = "vllm_dp_elastic_ep_requested_data_parallel_size"


def reads_of(client: FleetClient) -> tuple[ElasticEpRead, ...]:
    """Each target's last elastic-EP read, as the client's observations give it."""
    found = elastic_ep_reads(client.observations)
    assert found is not None  # HTTP mode always has API servers to ask
    return found


async def fleet(
    start_api: StartApi, start_exporter: ServiceFactory, *options: dict[str, Any], **config: Any
) -> tuple[list[ApiServer], Service]:
    """One API server of two engines per ``options`` (fleet-wide DP ranks 0-1, 2-3, ...),
    named ``NAMES``, and the exporter over them."""
    apis = [await start_api(engines=2, story_offset=2 * i, **o) for i, o in enumerate(options)]
    targets = [f"{name}={api.url}" for name, api in zip(NAMES, apis, strict=False)]
    ex = await start_exporter(http_config(targets, **config))
    await ex.fresh_poll()
    return apis, ex


async def state(ex: Service) -> dict[str, Any]:
    """Per target: its phase series (phase → value, {} when absent), epoch and requested-size
    samples, and its ``/status`` entry; every engine's is_sleeping outcome and up series."""
    m = parse_metrics(await ex.metrics())
    doc = await ex.status()
    validate_status(doc)
    entries = {e["target"]: e for e in doc["elastic_ep_operations"]}
    phases = {
        name: {
            p: value
            for p in ELASTIC_EP_PHASES
            if (value := metric_value(m, PHASE_FAMILY, target=name, phase=p)) is not None
        }
        for name in entries
    }
    return {
        "phases": phases,
        "epoch": {n: metric_value(m, EPOCH_FAMILY, target=n) for n in entries},
        "size": {n: metric_value(m, SIZE_FAMILY, target=n) for n in entries},
        "entries": entries,
        "sleeping": {
            e["engine"]: e["invariants"]["is_sleeping"]["outcome"] for e in doc["engines"]
        },
        "up": {
            e["engine"]: metric_value(m, "vllm_dp_engine_up", engine=e["engine"])
            for e in doc["engines"]
        },
        "doc": doc,
    }


def at_phase(name: str, phase: str, found: dict[str, Any]) -> bool:
    return bool(found["phases"][name] == one_hot(phase))


async def until(ex: Service, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """Fresh polls until ``check(state)`` holds (the read lands beside a poll's reads: in the
    poll that started it, or the next)."""
    for _ in range(6):
        await ex.fresh_poll()
        found = await state(ex)
        if check(found):
            return found
    raise AssertionError(f"never held: {found['entries']}")


def one_hot(phase: str) -> dict[str, float]:
    return {p: 1.0 if p == phase else 0.0 for p in ELASTIC_EP_PHASES}


def reads(api: ApiServer) -> int:
    return [path for _, path, _ in api.sim.requests].count(ELASTIC_EP_PATH)


def polls_unaffected(found: dict[str, Any]) -> None:
    assert set(found["sleeping"].values()) == {"ok"}, found["sleeping"]
    assert set(found["up"].values()) == {1.0}, found["up"]


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
async def test_an_operation_moves_through_its_phases_at_each_position(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    apis, ex = await fleet(start_api, start_exporter, {}, {}, {})
    name, sim = NAMES[position], apis[position].sim
    found = await until(ex, lambda s: s["phases"] == {n: one_hot("idle") for n in NAMES})
    entry = found["entries"][name]
    assert entry == {
        "target": name,
        "phase": "idle",
        "reported_phase": None,
        "scaling": False,
        "epoch": None,
        "error": None,
        "requested_data_parallel_size": None,
        "supported": True,
        "read_at_unix": entry["read_at_unix"],
        "problem": None,
    }
    assert time.time() - 60 < entry["read_at_unix"] <= time.time()
    assert found["epoch"] == found["size"] == dict.fromkeys(NAMES)
    assert 'id="elastic-section" hidden' in await page(ex)

    for phase, scaling in (("preparing", True), ("committing", True), ("completed", False)):
        sim.set_elastic_ep(phase, epoch="41", requested=4)
        found = await until(ex, functools.partial(at_phase, name, phase))
        assert all(found["phases"][n] == one_hot("idle") for n in NAMES if n != name)
        entry = found["entries"][name]
        assert (entry["phase"], entry["scaling"], entry["epoch"]) == (phase, scaling, "41")
        assert entry["requested_data_parallel_size"] == 4 and entry["problem"] is None
        assert found["epoch"] == {n: 41.0 if n == name else None for n in NAMES}
        assert found["size"] == {n: 4.0 if n == name else None for n in NAMES}
        polls_unaffected(found)
        html = await page(ex)
        assert (
            f'<li class="ee-{phase}" data-target="{name}"><strong>{name}</strong>: {phase}' in html
        )

    # The next operation fails (vLLM's epochs are UUIDs: no epoch series).
    sim.set_elastic_ep("failed", epoch="9c2e4f", error="rank 3 did not join", requested=2)
    found = await until(ex, lambda s: s["phases"][name] == one_hot("failed"))
    entry = found["entries"][name]
    assert (entry["epoch"], entry["error"], entry["scaling"]) == (
        "9c2e4f",
        "rank 3 did not join",
        False,
    )
    assert found["epoch"][name] is None and found["size"][name] == 2.0
    polls_unaffected(found)
    html = await page(ex)
    assert "failed, to DP size 2, epoch 9c2e4f, error: rank 3 did not join" in html
    # The Python client reads the field.
    status = Status.from_json(found["doc"])
    assert status.elastic_ep_operations is not None
    [failed] = [o for o in status.elastic_ep_operations if o.failed]
    assert (failed.target, failed.error, failed.requested_data_parallel_size) == (
        name,
        "rank 3 did not join",
        2,
    )

    sim.set_elastic_ep("idle")
    await until(ex, lambda s: s["phases"] == {n: one_hot("idle") for n in NAMES})


async def page(ex: Service) -> str:
    async with ex.session.get(ex.url + "/") as resp:
        assert resp.status == 200
        return await resp.text()


async def test_vllm_032_answers_only_whether_it_is_scaling(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis, ex = await fleet(start_api, start_exporter, {"vllm_version": "0.32.0"}, {})
    apis[0].sim.set_elastic_ep("preparing", epoch="7", requested=4)  # 0.32 says only "scaling"
    found = await until(ex, lambda s: s["phases"]["first"] == one_hot("committing"))
    entry = found["entries"]["first"]
    assert (entry["scaling"], entry["epoch"], entry["requested_data_parallel_size"]) == (
        True,
        None,
        None,
    )
    assert found["epoch"]["first"] is None and found["size"]["first"] is None
    apis[0].sim.set_elastic_ep("completed")
    await until(ex, lambda s: s["phases"]["first"] == one_hot("idle"))


@pytest.mark.parametrize(("release", "code"), [("0.32.1", 404), ("0.33.0", 501)])
async def test_the_rust_front_end_is_unsupported_here(
    start_api: StartApi, start_exporter: ServiceFactory, release: str, code: int
) -> None:
    """404 (the 0.32 binary) or 501 (0.33): no series for that target, nothing blanked, the
    route not asked again at every poll."""
    apis, ex = await fleet(start_api, start_exporter, {}, {"rust_front_end": release}, {})
    apis[1].sim.set_elastic_ep("committing")  # never served by the Rust front end
    apis[2].sim.set_elastic_ep("preparing", epoch="5")
    found = await until(ex, lambda s: s["phases"]["last"] == one_hot("preparing"))
    for _ in range(2):
        await ex.fresh_poll()
    found = await state(ex)
    entry = found["entries"]["middle"]
    assert entry["supported"] is False and entry["phase"] is None
    assert entry["problem"] == f"unsupported here: HTTP {code} from POST /is_scaling_elastic_ep"
    assert found["phases"]["middle"] == {} and found["epoch"]["middle"] is None
    assert found["phases"]["first"] == one_hot("idle") and found["epoch"]["last"] == 5.0
    polls_unaffected(found)
    assert reads(apis[1]) == 1 and reads(apis[0]) >= 4
    assert 'id="elastic-section"' in (html := await page(ex)) and "unsupported here" in html


async def test_a_503_is_the_targets_problem_until_the_store_answers(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis, ex = await fleet(start_api, start_exporter, {}, {}, {})
    apis[1].sim.set_elastic_ep("committing", epoch="3")
    await until(ex, lambda s: s["phases"]["middle"] == one_hot("committing"))
    apis[1].sim.elastic_ep.unavailable = True
    found = await until(ex, lambda s: s["entries"]["middle"]["problem"] is not None)
    entry = found["entries"]["middle"]
    assert entry["problem"] == (
        "HTTP 503 from POST /is_scaling_elastic_ep: "
        "External Elastic EP status is temporarily unavailable"
    )
    assert entry["phase"] is None and entry["supported"] is True
    # Not known now: no series for it (never the committing it was), the others as they are.
    assert found["phases"]["middle"] == {} and found["epoch"]["middle"] is None
    assert found["phases"]["first"] == one_hot("idle")
    polls_unaffected(found)
    assert "External Elastic EP status is temporarily unavailable" in await page(ex)
    apis[1].sim.elastic_ep.unavailable = False
    await until(ex, lambda s: s["phases"]["middle"] == one_hot("committing"))


#: Answers that are no operation: (body, what ``/status`` says of them).
HOSTILE = {
    "ten_megabytes": (b'{"phase": "' + b"x" * (10 << 20) + b'"}', "longer than 65536 bytes"),
    "not_json": (b"<html>502 Bad Gateway</html>", "not JSON"),
    "wrong_types": (
        json.dumps({"is_scaling_elastic_ep": "yes", "phase": 3}).encode(),
        "is_scaling_elastic_ep is str, not a boolean",
    ),
    "nested": (json.dumps({"phase": {"a": [[["failed"]]]}}).encode(), "phase is dict"),
    "deep_nesting": (b"[" * 20_000 + b"]" * 20_000, "not JSON (or nested too deeply)"),
    "size_a_string": (
        json.dumps({"phase": "preparing", "requested_data_parallel_size": "4"}).encode(),
        "requested_data_parallel_size is str",
    ),
}


@pytest.mark.parametrize(("body", "why"), HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_hostile_answer_is_unreadable_and_changes_nothing_else(
    start_api: StartApi, start_exporter: ServiceFactory, body: bytes, why: str
) -> None:
    apis, ex = await fleet(start_api, start_exporter, {}, {}, {})
    apis[2].sim.set_elastic_ep("committing")
    await until(ex, lambda s: s["phases"]["last"] == one_hot("committing"))
    apis[2].sim.elastic_ep.answer = body
    found = await until(ex, lambda s: s["entries"]["last"]["problem"] is not None)
    problem = found["entries"]["last"]["problem"]
    assert why in problem and len(problem) < 300, problem
    assert found["phases"]["last"] == {} and found["entries"]["last"]["phase"] is None
    assert found["phases"]["first"] == found["phases"]["middle"] == one_hot("idle")
    polls_unaffected(found)  # /metrics and /status answered above, every poll read the engines
    if len(body) > MAX_ELASTIC_EP_ANSWER:  # refused unread: the poll's own reads never waited
        assert ex.exporter.poller.snapshot.poll_duration_s < 1.0
    apis[2].sim.elastic_ep.answer = None
    await until(ex, lambda s: s["phases"]["last"] == one_hot("committing"))


async def test_a_route_that_hangs_never_delays_the_polls(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis, ex = await fleet(start_api, start_exporter, {}, {}, call_timeout=2.0)
    apis[0].sim.elastic_ep.delay_s = 30.0
    before, started = reads(apis[0]), time.monotonic()
    for _ in range(2):  # four polls, well within the read's deadline
        await ex.fresh_poll()
    snap = ex.exporter.poller.snapshot
    assert snap.poll_duration_s < 0.5 and all(e.up for e in snap.engines)
    client = ex.exporter.client
    await eventually(
        lambda: (reads_of(client) or ())[0].problem is not None,
        what="the hung read's deadline",
    )
    [first, second] = reads_of(client) or ()
    assert first.problem == "no answer from POST /is_scaling_elastic_ep within 2s"
    assert second.operation is not None and second.operation.phase == "idle"
    assert time.monotonic() - started < 6.0
    # One read in flight at a time: the four polls meanwhile sent one request.
    assert reads(apis[0]) == before + 1


async def test_unsupported_is_asked_again_after_the_server_was_unreachable() -> None:
    """A 404 is remembered until the target was unreachable: the server that comes back on the
    same address may be another vLLM, with the route."""
    runner, url = await start_api_server(
        HOST, 0, engines=1, missing_routes=frozenset({ELASTIC_EP_PATH})
    )
    port = int(url.rsplit(":", 1)[1])
    client = HttpFleetClient(parse_targets([f"a={url}"]))
    await client.start()
    try:

        async def poll() -> None:
            client.observations.refresh(2.0)
            await client.call_utility("is_sleeping", timeout_s=2)

        await poll()
        await eventually(lambda: reads_of(client)[0].supported is False)
        for _ in range(3):
            await poll()
        assert [p for _, p, _ in sim_of(runner).requests].count(ELASTIC_EP_PATH) == 1
        await runner.cleanup()
        await poll()  # unreachable: is_sleeping disconnected
        runner, _ = await start_api_server(HOST, port, engines=1)
        sim_of(runner).set_elastic_ep("preparing", epoch="12", requested=3)
        await poll()
        await eventually(lambda: reads_of(client)[0].operation is not None)
        [read] = reads_of(client)
        assert read.supported and read.operation is not None
        assert (read.operation.phase, read.operation.epoch_number) == ("preparing", 12)
    finally:
        await client.close()
        await runner.cleanup()


async def test_a_plugin_target_is_asked_at_its_server_root(start_api: StartApi) -> None:
    """vLLM serves the route at the root, not under the plugin's ``/dp``."""
    api = await start_api(engines=1)
    api.sim.set_elastic_ep("committing", epoch="8")
    client = HttpFleetClient(parse_targets([f"p={api.url}/dp"]))
    await client.start()
    try:
        client.observations.refresh(2.0)
        await eventually(lambda: reads_of(client)[0].read_at_unix is not None)
        [read] = reads_of(client)
        assert read.target == "p" and read.operation is not None
        assert read.operation.phase == "committing"
        assert ("POST", ELASTIC_EP_PATH) in [(m, p) for m, p, _ in api.sim.requests]
    finally:
        await client.close()
