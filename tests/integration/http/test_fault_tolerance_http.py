"""HTTP mode learns each target's fault-tolerance status from vLLM 0.33's
``GET /fault_tolerance/status`` (or ``/v1/fault_tolerance/status``, where vLLM's PR #46370 may
move it): the full exporter over simulated API servers on loopback, read back through
``/metrics``, ``/status`` and ``GET /gate?healthy=true``; the statuses of vLLM's PR #41438
(``paused``, ``recovering``) and any other string (``other``) included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from exporter.client.http.client import HttpFleetClient
from exporter.client.http.replies import MAX_FT_ANSWER
from exporter.client.pushes import BAD_FT_STATUS
from exporter.control.attach import parse_targets
from exporter.protocol.pushes import FT_STATE_VALUES
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING
from exporter.sim.api_server import sim_of, start_api_server
from tests.harness.apiservers import HOST, ApiServer, StartApi, http_config
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import Service, ServiceFactory

FT_PATH = "/fault_tolerance/status"
V1_PATH = "/v1" + FT_PATH
FT_FAMILY = "vllm_dp_engine_fault_tolerance_status"
NAMES = ("first", "middle", "last")


async def fleet(
    start_api: StartApi,
    start_exporter: ServiceFactory,
    *,
    fault_tolerance: tuple[bool, ...],
    prefixes: tuple[str, ...] = (),
) -> tuple[list[ApiServer], Service]:
    """One API server of two engines per flag (fleet-wide DP ranks 0-1, 2-3, ...), named
    ``NAMES``, each serving the route under its ``prefixes`` entry (``""``: the root), and the
    exporter over them (a fresh gate sample on every request)."""
    apis = [
        await start_api(
            engines=2,
            story_offset=2 * i,
            fault_tolerance=on,
            fault_tolerance_prefix=prefixes[i] if i < len(prefixes) else "",
        )
        for i, on in enumerate(fault_tolerance)
    ]
    targets = [f"{name}={api.url}" for name, api in zip(NAMES, apis, strict=False)]
    ex = await start_exporter(http_config(targets, gate_min_interval=0))
    await ex.fresh_poll()
    return apis, ex


async def ft_state(ex: Service) -> dict[str, Any]:
    """Per engine: its state-set series (status → value, {} when absent) and its ``/status``
    entry; the fleet's faulty count and top-level ``/status`` verdict."""
    m = parse_metrics(await ex.metrics())
    doc = await ex.status()
    series = {
        e["engine"]: {
            s: metric_value(m, FT_FAMILY, engine=e["engine"], status=s)
            for s in FT_STATE_VALUES
            if metric_value(m, FT_FAMILY, engine=e["engine"], status=s) is not None
        }
        for e in doc["engines"]
    }
    return {
        "series": series,
        "entries": {e["engine"]: e["fault_tolerance"] for e in doc["engines"]},
        "faulty": metric_value(m, "vllm_dp_fault_tolerance_faulty_engines"),
        "fleet": doc["fault_tolerance"],
    }


def one_hot(status: str) -> dict[str, float]:
    return {s: 1.0 if s == status else 0.0 for s in FT_STATE_VALUES}


async def gate(ex: Service) -> tuple[int, Any]:
    return await ex.get_json("/gate?healthy=true")


def ft_requests(api: ApiServer, path: str = FT_PATH) -> int:
    return [p for _, p, _ in api.sim.requests].count(path)


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
async def test_unhealthy_and_back_at_each_position(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True, True))
    name, rank = NAMES[position], 2 * position + 1
    state = await ft_state(ex)
    assert state["series"] == {n: one_hot("healthy") for n in NAMES}
    assert {n: e["status"] for n, e in state["entries"].items()} == dict.fromkeys(NAMES, "healthy")
    assert state["faulty"] == 0
    assert state["fleet"] == {
        "healthy": True,
        "faulty_engines": [],
        "reported_engines": list(NAMES),
    }
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (200, [])

    apis[position].sim.set_fault_status(1, "unhealthy", "RuntimeError")
    # The gate's own fan-out asks the route: no poll needed.
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, [name])
    [failing] = [e for e in body["engines"] if e["engine"] == name]
    assert failing["values"]["healthy"] is False
    assert any(f"rank {rank}: RuntimeError" in f for f in failing["failures"]), failing
    await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"][name] == one_hot("unhealthy")
    assert all(state["series"][n] == one_hot("healthy") for n in NAMES if n != name)
    entry = state["entries"][name]
    assert (entry["status"], entry["fault_info"]) == ("unhealthy", f"rank {rank}: RuntimeError")
    assert state["faulty"] == 1
    assert state["fleet"]["healthy"] is False and state["fleet"]["faulty_engines"] == [name]
    # Unchanged answers keep the time the status was first seen.
    await ex.fresh_poll()
    assert (await ft_state(ex))["entries"][name]["since_unix"] == entry["since_unix"]

    apis[position].sim.set_fault_status(1, "healthy")
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (200, [])
    await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"] == {n: one_hot("healthy") for n in NAMES}
    assert state["entries"][name]["fault_info"] is None
    assert state["entries"][name]["since_unix"] >= entry["since_unix"]
    assert state["faulty"] == 0 and state["fleet"]["healthy"] is True


async def test_worst_rank_of_a_target_wins(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True))
    apis[1].sim.set_fault_status(0, "dead")
    apis[1].sim.set_fault_status(1, "unhealthy", "ValueError")
    apis[1].sim.recovery_failed("req-1", "retry timed out")
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, ["middle"])
    await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"]["middle"] == one_hot("dead")
    assert state["entries"]["middle"]["fault_info"] == (
        "rank 2: dead, recovery failed: retry timed out; rank 3: ValueError"
    )
    assert state["series"]["first"] == one_hot("healthy")


async def test_target_without_the_route(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """vLLM without --enable-fault-tolerance answers 404: no series, not a failing gate, and
    the route is not asked again (one GET beside each poll's is_sleeping for the others)."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, False, True))
    for _ in range(3):
        await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"]["middle"] == {}
    assert state["entries"]["middle"] is None
    assert state["fleet"]["reported_engines"] == ["first", "last"]
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (200, [])
    assert ft_requests(apis[1]) == 1
    sleeping = [p for _, p, _ in apis[0].sim.requests].count("/is_sleeping")
    assert ft_requests(apis[0]) == sleeping >= 4
    apis[2].sim.set_fault_status(0, "unhealthy", "RuntimeError")
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, ["last"])
    assert ex.exporter.client.capabilities.fault_status


#: Answers that cannot be read as a whole, or whose one rank's status cannot be read.
HOSTILE = {
    "not_json": b"<html>502 Bad Gateway</html>",
    "deep_nesting": b'{"engines": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "wrong_types": json.dumps(
        {"engines": [{"id": "0", "status": "healthy"}, {"id": 1, "status": 3}]}
    ).encode(),
    "status_not_hashable": json.dumps({"engines": [{"id": 0, "status": ["dead"]}]}).encode(),
    "status_as_a_map": json.dumps({"engines": [{"id": 0, "status": {"name": "dead"}}]}).encode(),
    "no_status": json.dumps({"engines": [{"id": 0, "fault_info": "x"}]}).encode(),
    "healthy_beside_a_bad_entry": json.dumps(
        {"engines": [{"id": 0, "status": "healthy"}, {"id": True, "status": "healthy"}]}
    ).encode(),
    "a_rank_twice": json.dumps(
        {"engines": [{"id": 0, "status": "healthy"}, {"id": 0, "status": "healthy"}]}
    ).encode(),
    "not_an_object": b'[{"id": 0, "status": "dead"}]',
    "too_long": b'{"engines": [' + b'{"id": 0, "status": "dead"},' * (MAX_FT_ANSWER // 20),
}


@pytest.mark.parametrize("body", HOSTILE.values(), ids=HOSTILE.keys())
async def test_an_unreadable_answer_fails_closed(
    start_api: StartApi, start_exporter: ServiceFactory, body: bytes
) -> None:
    """E1: a healthy target whose answer turns unreadable is unknown (never the healthy it
    was), counted; /metrics and /status keep answering; readable again, healthy again."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True))
    await ex.fresh_poll()
    assert (await gate(ex))[0] == 200
    client = ex.exporter.client
    assert isinstance(client, HttpFleetClient)
    counted = client.faults.counts.get(BAD_FT_STATUS, 0)
    apis[0].sim.ft_answer = body
    await ex.fresh_poll()
    await ex.fresh_poll()
    state = await ft_state(ex)  # /metrics and /status still answer
    assert state["entries"]["first"]["status"] == "unknown"
    assert "unreadable status" in state["entries"]["first"]["fault_info"]
    assert state["series"]["first"] == one_hot("unknown")
    assert state["series"]["middle"] == one_hot("healthy")
    assert client.faults.counts.get(BAD_FT_STATUS, 0) >= counted + 2
    status, body_ = await gate(ex)
    assert status == 412 and body_["failing_engines"] == ["first"], body_
    apis[0].sim.ft_answer = None
    await ex.fresh_poll()
    assert (await gate(ex))[0] == 200


async def test_a_fault_info_that_is_not_text_keeps_the_status(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """E1: the one rule of every mode: the status counts, fault_info is its repr, not counted."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True))
    client = ex.exporter.client
    assert isinstance(client, HttpFleetClient)
    apis[1].sim.ft_answer = json.dumps(
        {"engines": [{"id": 0, "status": "dead", "fault_info": {"a": [1]}}]}
    ).encode()
    await ex.fresh_poll()
    await ex.fresh_poll()
    entry = (await ft_state(ex))["entries"]["middle"]
    assert entry["status"] == "dead" and entry["fault_info"] == "rank 0: {'a': [1]}"
    assert client.faults.counts.get(BAD_FT_STATUS, 0) == 0
    status, body = await gate(ex)
    assert status == 412 and body["failing_engines"] == ["middle"]


async def test_huge_fault_info_is_cut(start_api: StartApi, start_exporter: ServiceFactory) -> None:
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True,))
    apis[0].sim.set_fault_status(1, "unhealthy", "E" * 1_000_000)
    await ex.fresh_poll()
    entry = (await ft_state(ex))["entries"]["first"]
    info = entry["fault_info"]
    assert entry["status"] == "unhealthy"
    assert info.startswith("rank 1: EEE") and CUT_MARKER in info
    assert len(info.encode()) <= MAX_ENGINE_STRING
    status, body = await gate(ex)
    assert status == 412 and len(json.dumps(body)) < 4096


async def test_route_asked_again_after_the_target_was_unreachable(
    clients: list[HttpFleetClient],
) -> None:
    """A 404 is remembered until the target was unreachable: the server that comes back on the
    same address may be another vLLM, with fault tolerance on."""
    runner, url = await start_api_server(HOST, 0, engines=1)
    port = int(url.rsplit(":", 1)[1])
    client = HttpFleetClient(parse_targets([f"a={url}"]))
    await client.start()
    clients.append(client)
    try:
        for _ in range(3):
            await client.call_utility("is_sleeping", timeout_s=2)
        assert [p for _, p, _ in sim_of(runner).requests].count(FT_PATH) == 1
        assert client.engine_details()[0].fault_status is None
    finally:
        await runner.cleanup()
    [gone] = await client.call_utility("is_sleeping", timeout_s=2)
    assert not gone.ok
    runner, _ = await start_api_server(HOST, port, engines=1, fault_tolerance=True)
    try:
        sim_of(runner).set_fault_status(0, "unhealthy", "RuntimeError")
        [back] = await client.call_utility("is_sleeping", timeout_s=2)
        assert back.ok
        ft = client.engine_details()[0].fault_status
        assert ft is not None
        assert (ft.status, ft.fault_info) == ("unhealthy", "rank 0: RuntimeError")
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
async def test_statuses_beyond_0_33_at_each_position(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    """vLLM PR #41438's ``recovering`` and ``paused`` are their own values, a status no vLLM
    has is ``other`` (its string in ``fault_info``, not a label): each fails the gate naming
    the target, none is counted as unreadable; ``healthy`` again opens the gate."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True, True))
    client = ex.exporter.client
    assert isinstance(client, HttpFleetClient)
    name, rank = NAMES[position], 2 * position
    for sent, shown, info in (
        ("recovering", "recovering", f"rank {rank}: recovering"),
        ("paused", "paused", f"rank {rank}: paused"),
        ("zzz-new", "other", f"rank {rank}: status 'zzz-new'"),
    ):
        apis[position].sim.set_fault_status(0, sent)
        status, body = await gate(ex)
        assert (status, body["failing_engines"]) == (412, [name]), sent
        [failing] = [e for e in body["engines"] if e["engine"] == name]
        assert any(f"reports {shown} ({info})" in f for f in failing["failures"]), failing
        await ex.fresh_poll()
        state = await ft_state(ex)
        assert state["series"][name] == one_hot(shown)
        assert all(state["series"][n] == one_hot("healthy") for n in NAMES if n != name)
        assert (state["entries"][name]["status"], state["entries"][name]["fault_info"]) == (
            shown,
            info,
        )
        assert state["faulty"] == 1 and state["fleet"]["faulty_engines"] == [name]
    assert "zzz-new" not in await ex.metrics()
    assert client.faults.counts.get(BAD_FT_STATUS, 0) == 0
    apis[position].sim.set_fault_status(0, "healthy")
    assert (await gate(ex))[0] == 200
    await ex.fresh_poll()
    assert (await ft_state(ex))["series"][name] == one_hot("healthy")


async def test_a_server_with_the_route_under_v1_only(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """A vLLM that serves ``/v1/fault_tolerance/status`` only (PR #46370): its ranks' statuses
    are read (before, they had none and the gate passed them), the route that answered is
    remembered (the root's 404 is asked once), and the worst rank wins as at the root."""
    apis, ex = await fleet(
        start_api,
        start_exporter,
        fault_tolerance=(True, True, True),
        prefixes=("", "/v1", "/v1"),
    )
    state = await ft_state(ex)
    assert state["series"] == {n: one_hot("healthy") for n in NAMES}
    assert state["fleet"]["reported_engines"] == list(NAMES)
    assert (await gate(ex))[0] == 200
    apis[1].sim.set_fault_status(0, "paused")
    apis[1].sim.set_fault_status(1, "unhealthy", "RuntimeError")
    apis[2].sim.set_fault_status(1, "recovering")
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, ["middle", "last"])
    await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"]["middle"] == one_hot("unhealthy")
    assert state["entries"]["middle"]["fault_info"] == "rank 2: paused; rank 3: RuntimeError"
    assert state["series"]["last"] == one_hot("recovering")
    assert state["series"]["first"] == one_hot("healthy")
    for api in apis[1:]:
        assert ft_requests(api) == 1  # the root's 404, once
        assert ft_requests(api, V1_PATH) == ft_requests(apis[0]) >= 3
    assert ft_requests(apis[0], V1_PATH) == 0
    apis[1].sim.set_fault_status(1, "healthy")
    apis[1].sim.set_fault_status(0, "healthy")
    apis[2].sim.set_fault_status(1, "healthy")
    assert (await gate(ex))[0] == 200


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
async def test_vllm_0_34_s_route_behind_its_api_key(
    start_api: StartApi, start_exporter: ServiceFactory, tmp_path: Path, position: int
) -> None:
    """vLLM 0.34 serves ``/v1/fault_tolerance/status`` only, behind its ``--api-key`` like every
    ``/v1`` route. With the key in ``--http-token-file`` every rank's status is read (a
    ``diagnosing`` rank too); without it the route answers 401 and that server's ranks read
    ``unknown``, never healthy, and the gate holds."""
    apis = [
        await start_api(
            engines=2,
            story_offset=2 * i,
            fault_tolerance=True,
            fault_tolerance_prefix="/v1",
            api_key="sk-vllm",
        )
        for i in range(3)
    ]
    targets = [f"{name}={api.url}" for name, api in zip(NAMES, apis, strict=True)]
    token = tmp_path / "token"
    token.write_text("sk-vllm\n")
    keyed = await start_exporter(
        http_config(targets, gate_min_interval=0, http_token_file=str(token))
    )
    apis[position].sim.set_fault_status(2 * position + 1, "diagnosing")
    await keyed.fresh_poll()
    state = await ft_state(keyed)
    me = NAMES[position]
    assert state["series"][me] == one_hot("diagnosing")
    assert all(state["series"][n] == one_hot("healthy") for n in NAMES if n != me)
    assert (await gate(keyed))[1]["failing_engines"] == [me]
    keyless = await start_exporter(http_config(targets, gate_min_interval=0))
    await keyless.fresh_poll()
    state = await ft_state(keyless)
    assert all(state["series"][n] == one_hot("unknown") for n in NAMES), state["series"]
    status, body = await gate(keyless)
    assert status == 412 and body["failing_engines"] == list(NAMES)


async def test_a_server_with_neither_route_has_no_status(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """Fault tolerance off: both routes answer 404, once each; no series, the gate open."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(False, True))
    for _ in range(3):
        await ex.fresh_poll()
    state = await ft_state(ex)
    assert state["series"]["first"] == {} and state["entries"]["first"] is None
    assert (ft_requests(apis[0]), ft_requests(apis[0], V1_PATH)) == (1, 1)
    assert (await gate(ex))[0] == 200


async def test_the_other_route_is_asked_when_the_remembered_one_answers_404(
    clients: list[HttpFleetClient],
) -> None:
    """A server that served the route under ``/v1/`` comes back serving it at the root (and
    the other way round): the remembered route's 404 sends the exporter to the other at once,
    which is remembered from then on."""
    runner, url = await start_api_server(
        HOST, 0, engines=1, fault_tolerance=True, fault_tolerance_prefix="/v1"
    )
    port = int(url.rsplit(":", 1)[1])
    client = HttpFleetClient(parse_targets([f"a={url}"]))
    await client.start()
    clients.append(client)
    try:
        sim_of(runner).set_fault_status(0, "recovering")
        for _ in range(2):
            await client.call_utility("is_sleeping", timeout_s=2)
        paths = [p for _, p, _ in sim_of(runner).requests if "fault" in p]
        assert paths == [FT_PATH, V1_PATH, V1_PATH]
        ft = client.engine_details()[0].fault_status
        assert ft is not None and ft.status == "recovering"
    finally:
        await runner.cleanup()
    [gone] = await client.call_utility("is_sleeping", timeout_s=2)
    assert not gone.ok
    for prefix, asked in (("", [V1_PATH, FT_PATH, FT_PATH]), ("/v1", [FT_PATH, V1_PATH, V1_PATH])):
        runner, _ = await start_api_server(
            HOST, port, engines=1, fault_tolerance=True, fault_tolerance_prefix=prefix
        )
        try:
            sim_of(runner).set_fault_status(0, "unhealthy", prefix or "root")
            for _ in range(2):
                [answer] = await client.call_utility("is_sleeping", timeout_s=2)
                assert answer.ok
            assert [p for _, p, _ in sim_of(runner).requests if "fault" in p] == asked
            ft = client.engine_details()[0].fault_status
            assert ft is not None
            assert (ft.status, ft.fault_info) == ("unhealthy", f"rank 0: {prefix or 'root'}")
        finally:
            await runner.cleanup()


async def test_a_hostile_status_string_is_cut_and_never_a_label(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """10 KB of status with control characters: ``other``, the string cut and escaped in
    ``fault_info``, no label of its own, not counted; /metrics stays small and parseable."""
    apis, ex = await fleet(start_api, start_exporter, fault_tolerance=(True, True))
    client = ex.exporter.client
    assert isinstance(client, HttpFleetClient)
    hostile = ('zzz\x00\x07\r\n"}\u202e\x1b[2J' + "q" * 40) * 200
    assert len(hostile.encode()) > 10_000
    apis[1].sim.set_fault_status(1, hostile)
    await ex.fresh_poll()
    state = await ft_state(ex)
    entry = state["entries"]["middle"]
    assert entry["status"] == "other" and state["series"]["middle"] == one_hot("other")
    info = entry["fault_info"]
    assert info.startswith("rank 3: status 'zzz\\x00\\x07\\r\\n")
    assert CUT_MARKER in info and len(info.encode()) <= MAX_ENGINE_STRING
    assert all(c.isprintable() for c in info)
    text = await ex.metrics()
    assert "zzz" not in text and len(text) < 100_000
    statuses = {s.labels["status"] for s in parse_metrics(text)[FT_FAMILY].samples}
    assert statuses == set(FT_STATE_VALUES)
    assert client.faults.counts.get(BAD_FT_STATUS, 0) == 0
    status, body = await gate(ex)
    assert status == 412 and body["failing_engines"] == ["middle"] and len(json.dumps(body)) < 4096


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
async def test_a_gate_never_passes_on_a_status_read_before_it_was_asked(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    """A server whose route answers slower than the gate's deadline (0.7 s against 0.9 times a
    0.5 s call timeout) after its rank turned unhealthy: ``healthy=true`` is 412 with the
    target's status unknown, never 200 from the healthy status an earlier read kept."""
    apis = [await start_api(engines=2, story_offset=2 * i, fault_tolerance=True) for i in range(3)]
    targets = [f"{name}={api.url}" for name, api in zip(NAMES, apis, strict=True)]
    ex = await start_exporter(http_config(targets, gate_min_interval=0, call_timeout=0.5))
    await ex.fresh_poll()
    assert (await gate(ex))[0] == 200
    apis[position].sim.ft_delay_s = 0.7
    apis[position].sim.set_fault_status(1, "unhealthy", "RuntimeError")
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, [NAMES[position]]), body
    [failing] = [e for e in body["engines"] if e["engine"] == NAMES[position]]
    assert any("not read" in f for f in failing["failures"]), failing
    # Once the route answers in time again, the gate reads the rank's real status.
    apis[position].sim.ft_delay_s = 0.0
    status, body = await gate(ex)
    assert (status, body["failing_engines"]) == (412, [NAMES[position]]), body
    [failing] = [e for e in body["engines"] if e["engine"] == NAMES[position]]
    assert any("RuntimeError" in f for f in failing["failures"]), failing
