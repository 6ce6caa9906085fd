"""The full exporter (Exporter + create_app) with --attach http against simulated API servers."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.client.http.replies import DEV_MODE_OFF
from exporter.metrics.catalog import METRICS
from exporter.sim.engine import SimEngine
from exporter.sim.options import SimOptions
from tests.harness.apiservers import HOST, StartApi, http_config
from tests.harness.service import Service, ServiceFactory

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    for n, lbl, v in samples(text):
        if n == name and all(lbl.get(k) == want for k, want in labels.items()):
            return v
    return None


def families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def label_names(text: str) -> dict[str, set[frozenset[str]]]:
    names: dict[str, set[frozenset[str]]] = {}
    for n, lbl, _ in samples(text):
        names.setdefault(n, set()).add(frozenset(lbl))
    return names


def key_shape(obj: Any) -> Any:
    """The keys of a JSON document, recursively (lists: the union of their items' shapes)."""
    if isinstance(obj, dict):
        return {k: key_shape(v) for k, v in obj.items()}
    if isinstance(obj, list) and obj and all(isinstance(i, dict) for i in obj):
        merged: dict[str, Any] = {}
        for item in obj:
            merged.update(key_shape(item))
        return [merged]
    return None


async def test_inconsistent_target_through_the_exporter(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    a = await start_api(engines=1)
    b = await start_api(
        engines=3, engine_options=[SimOptions(), SimOptions(sleeping=True), SimOptions()]
    )
    ex = await start_exporter(http_config([f"node-a={a.url}", f"node-b={b.url}"]))
    await ex.fresh_poll()
    text = await ex.metrics()
    assert value(text, "vllm_dp_fleet_state", state="inconsistent") == 1
    assert value(text, "vllm_dp_fleet_state", state="consistent") == 0
    assert value(text, "vllm_dp_sleep_state_consistent") == 0
    assert value(text, "vllm_dp_sleeping") is None
    calls = value(
        text,
        "vllm_dp_utility_calls_total",
        method="is_sleeping",
        engine="node-b",
        outcome="inconsistent",
    )
    assert calls is not None and calls >= 2
    assert value(
        text, "vllm_dp_utility_calls_total", method="is_sleeping", engine="node-a", outcome="ok"
    )
    total = value(text, "vllm_dp_inconsistent_utility_results_total", method="is_sleeping")
    assert total is not None and total >= 2
    assert value(text, "vllm_dp_engines_connected") == 2
    assert value(text, "vllm_dp_engines_expected") == 2
    # The paused query goes to GET /is_paused: node-b's own engines disagree there too.
    assert value(text, "vllm_dp_engine_paused", engine="node-a") == 0
    assert value(text, "vllm_dp_engine_paused", engine="node-b") is None
    status = await ex.status()
    assert status["attach"] == "http"
    assert status["aggregate"]["is_sleeping"]["consistent"] is False
    assert status["aggregate"]["is_sleeping"]["state"] == "inconsistent"
    assert status["aggregate"]["is_sleeping"]["values"] == [False, [False, True, False]]
    by_engine = {e["engine"]: e for e in status["engines"]}
    node_a = by_engine["node-a"]["invariants"]["is_sleeping"]
    node_b = by_engine["node-b"]["invariants"]["is_sleeping"]
    assert node_b["outcome"] == "inconsistent"
    assert node_b["values"] == [False, True, False]
    assert by_engine["node-b"]["address"] == b.url
    assert node_a["outcome"] == "ok" and node_a["value"] is False
    assert status["aggregate"]["is_scheduler_paused"]["state"] == "inconsistent"


async def test_agreeing_targets_are_consistent_and_ready(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    a = await start_api(engines=2, engine_options=[SimOptions(sleeping=True)] * 2)
    b = await start_api(engines=2, engine_options=[SimOptions(sleeping=True)] * 2)
    ex = await start_exporter(http_config([a.url, b.url]))
    await ex.fresh_poll()
    text = await ex.metrics()
    assert value(text, "vllm_dp_fleet_state", state="consistent") == 1
    assert value(text, "vllm_dp_sleeping") == 1
    assert value(text, "vllm_dp_engine_sleeping", engine="0") == 1
    assert value(text, "vllm_dp_engine_up", engine="1") == 1
    async with ex.session.get(f"{ex.url}/readyz") as resp:
        assert resp.status == 200
    # Each target's vLLM version comes from GET /version, off the poll path.
    for _ in range(50):
        await ex.fresh_poll()
        text = await ex.metrics()
        if value(text, "vllm_dp_engine_info", engine="1", vllm_version="0.33.0") == 1:
            break
    else:
        raise AssertionError("vllm_dp_engine_info never got the targets' vLLM version")
    # A target going to sleep differently flips the fleet to inconsistent.
    for engine in b.sim.engines:
        engine.wake_up(None)
    await ex.fresh_poll()
    text = await ex.metrics()
    assert value(text, "vllm_dp_fleet_state", state="inconsistent") == 1


async def test_dev_mode_off_reported_as_failed(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    a = await start_api(engines=1)
    off = await start_api(engines=1, dev_mode=False)
    ex = await start_exporter(http_config([a.url, f"nodev={off.url}"]))
    await ex.fresh_poll()
    status = await ex.status()
    entry = {e["engine"]: e for e in status["engines"]}["nodev"]["invariants"]["is_sleeping"]
    assert entry["outcome"] == "failed"
    assert entry["error"] == DEV_MODE_OFF
    assert status["aggregate"]["is_sleeping"]["state"] == "unknown"
    text = await ex.metrics()
    assert value(text, "vllm_dp_fleet_state", state="unknown") == 1
    assert value(text, "vllm_dp_engine_up", engine="nodev") == 0
    assert value(
        text, "vllm_dp_utility_calls_total", method="is_sleeping", engine="nodev", outcome="failed"
    )


async def test_slow_target_does_not_delay_the_poll(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    a = await start_api(engines=1)
    slow = await start_api(engines=1, engine_options=[SimOptions(hang=True)])
    ex = await start_exporter(http_config([a.url, f"slow={slow.url}"], call_timeout=0.5))
    await ex.fresh_poll()
    snap = ex.exporter.poller.snapshot
    assert snap.poll_duration_s < 1.5
    text = await ex.metrics()
    assert value(
        text, "vllm_dp_utility_calls_total", method="is_sleeping", engine="slow", outcome="timeout"
    )
    assert value(text, "vllm_dp_engine_up", engine="0") == 1
    # The hung engine's server still answers GET /metrics (has_work): it is connected.
    assert value(text, "vllm_dp_engines_connected") == 2


async def test_admin_reset_partial_failure_names_the_target(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    good = await start_api(engines=2)
    refusing = await start_api(
        engines=2, engine_options=[SimOptions(), SimOptions(refuse_reset=True)]
    )
    ex = await start_exporter(http_config([f"good={good.url}", f"bad={refusing.url}"]))
    url = f"{ex.admin_url}/admin/reset_prefix_cache?reset_running_requests=true"
    async with ex.session.post(url) as resp:
        assert resp.status == 502
        body = await resp.json()
    assert body["success"] is False
    assert body["outcome"] == "partial_failure"
    assert body["failed_engines"] == ["bad"]
    assert body["engines"] == [
        {"engine": "good", "ok": True, "reason": None, "error": None},
        {"engine": "bad", "ok": False, "reason": "refused", "error": None},
    ]
    assert (
        "POST",
        "/reset_prefix_cache?reset_running_requests=true&reset_external=false",
        None,
    ) in refusing.sim.requests
    text = await ex.metrics()
    assert value(text, "vllm_dp_prefix_cache_resets_total", outcome="partial_failure") == 1
    assert (
        value(
            text, "vllm_dp_prefix_cache_reset_engine_failures_total", engine="bad", reason="refused"
        )
        == 1
    )
    refusing.sim.engines[1].refuse_reset = False
    async with ex.session.post(f"{ex.admin_url}/admin/reset_prefix_cache") as resp:
        assert resp.status == 200
        assert (await resp.json())["success"] is True


async def test_token_reaches_targets_and_stays_out_of_logs(
    start_api: StartApi,
    start_exporter: ServiceFactory,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    token = "tok-ABCDEF-0123456789"
    f = tmp_path / "http-token"
    f.write_text(token)
    caplog.set_level(logging.DEBUG)
    a = await start_api(engines=2, engine_options=[SimOptions(), SimOptions(sleeping=True)])
    gone = f"http://{HOST}:{free_listen_port()}"
    ex = await start_exporter(http_config([a.url, gone], http_token_file=str(f)))
    await ex.fresh_poll()
    async with ex.session.post(f"{ex.admin_url}/admin/reset_prefix_cache") as resp:
        assert resp.status == 502
        admin_text = await resp.text()
    assert {auth for _, _, auth in a.sim.requests} == {f"Bearer {token}"}
    for text in (caplog.text, await ex.metrics(), str(await ex.status()), admin_text):
        assert token not in text


# -- same shape as ZMQ (owner) mode ---------------------------------------------------------


@pytest.fixture
async def owner_exporter(start_exporter: ServiceFactory) -> AsyncIterator[Service]:
    from exporter.config.settings import resolve_config

    handshake = f"tcp://{HOST}:{free_listen_port()}"
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=2,
        handshake_address=handshake,
        listen=f"{HOST}:0",
        admin_listen=f"{HOST}:0",
        poll_interval=30.0,
        call_timeout=2.0,
        reset_min_interval=0.0,
    )
    ex = await start_exporter(config, first_poll=False)
    engines = [SimEngine(handshake, i, SimOptions(sleeping=i == 1)) for i in range(2)]
    tasks = [asyncio.create_task(e.run()) for e in engines]
    try:
        await asyncio.wait_for(asyncio.gather(*(e.connected.wait() for e in engines)), 8)
        yield ex
    finally:
        for e in engines:
            e.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)


async def test_metrics_and_status_shape_match_zmq_mode(
    start_api: StartApi, start_exporter: ServiceFactory, owner_exporter: Service
) -> None:
    a = await start_api(engines=1)
    b = await start_api(engines=1, engine_options=[SimOptions(sleeping=True)])
    http = await start_exporter(http_config([a.url, b.url]))
    # The targets' versions (engine_info) arrive from GET /version shortly after they answer.
    for _ in range(50):
        await http.fresh_poll()
        if all(d.vllm_version for d in http.exporter.client.engine_details()):
            break
        await asyncio.sleep(0.02)
    await http.fresh_poll()
    await owner_exporter.fresh_poll()
    for ex in (http, owner_exporter):
        async with ex.session.post(
            f"{ex.admin_url}/admin/reset_prefix_cache?reset_running_requests=true"
        ) as resp:
            assert resp.status == 200
    zmq_text, http_text = await owner_exporter.metrics(), await http.metrics()
    # Only the metrics the catalog marks as engine-socket ones (the state file) differ.
    zmq_only = {s.name for s in METRICS if "http" not in s.modes and "owner" in s.modes}
    assert zmq_only
    # And the families only HTTP mode declares (the request counts, from each target's
    # /metrics: owner mode has none).
    http_only = {s.name for s in METRICS if "http" in s.modes and "owner" not in s.modes}
    assert families(http_text) - http_only == families(zmq_text) - zmq_only
    zmq_labels, http_labels = label_names(zmq_text), label_names(http_text)
    for name in zmq_only:
        zmq_labels.pop(name, None)
    for name in http_only:
        http_labels.pop(name, None)
    for name in set(zmq_labels) & set(http_labels):
        assert http_labels[name] == zmq_labels[name], name
    # Nothing is missing: is_scheduler_paused goes to GET /is_paused, engine_info comes from
    # GET /version once a target answered.
    assert set(zmq_labels) == set(http_labels)
    # Same engine label values for the same positions (no names given: "0", "1").
    assert {lbl["engine"] for n, lbl, _ in samples(http_text) if n == "vllm_dp_engine_up"} == {
        "0",
        "1",
    }
    zmq_status, http_status = await owner_exporter.status(), await http.status()
    # Each API server's elastic-EP operation: HTTP mode asks each target, owner mode has none.
    assert zmq_status.pop("elastic_ep_operations") is None
    assert [o["target"] for o in http_status.pop("elastic_ep_operations")] == ["0", "1"]
    # Each engine's progress: HTTP mode reads the targets' token counters, owner mode has none.
    assert [e.pop("progress") for e in zmq_status["engines"]] == [None, None]
    assert [e.pop("progress")["source"] for e in http_status["engines"]] == ["metrics"] * 2
    assert key_shape(http_status) == key_shape(zmq_status)
    assert http_status["aggregate"]["is_sleeping"]["state"] == "inconsistent"
    assert zmq_status["aggregate"]["is_sleeping"]["state"] == "inconsistent"


@pytest.mark.parametrize("front_end", [None, "0.32.0"], ids=["python", "rust"])
async def test_a_target_whose_ranks_always_disagree_answers_and_is_never_hung(
    start_api: StartApi, start_exporter: ServiceFactory, front_end: str | None
) -> None:
    """Every read route answers the consensus error in milliseconds (the ranks behind one API
    server disagree on sleeping, paused and the weight version): the target answered, so it
    is never ``hung`` and its unresponsive seconds stay 0 past ``--hung-after``."""
    odd = SimOptions(sleeping=True, weight_version="v2")
    b = await start_api(
        engines=3,
        engine_options=[SimOptions(weight_version="v1"), odd, SimOptions(weight_version="v1")],
        rust_front_end=front_end,
    )
    a = await start_api(engines=1)
    config = http_config([f"node-a={a.url}", f"node-b={b.url}"], hung_after=0.5, call_timeout=0.5)
    ex = await start_exporter(config)
    for _ in range(4):  # over 1 s of polls: past --hung-after
        await ex.fresh_poll()
        await asyncio.sleep(0.3)
    await ex.fresh_poll()
    status = await ex.status()
    node_b = {e["engine"]: e for e in status["engines"]}["node-b"]
    outcomes = {m: i["outcome"] for m, i in node_b["invariants"].items()}
    assert outcomes.pop("checkpoint_state") == "unsupported"  # a server before vLLM 0.34
    assert set(outcomes.values()) == {"inconsistent"}, outcomes
    assert node_b["state"] != "hung" and node_b["unresponsive_seconds"] == 0, node_b
    text = await ex.metrics()
    assert value(text, "vllm_dp_engine_unresponsive_seconds", engine="node-b") == 0
