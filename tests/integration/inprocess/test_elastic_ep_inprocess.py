"""In-process mode reads the elastic-EP operation the way vLLM's own ``POST
/is_scaling_elastic_ep`` does: ``engine_client.get_external_elastic_ep_status()`` (vLLM 0.33),
else the process-local flag; a simulated ``AsyncLLM`` over real ZMQ engines, read back through
the embedded exporter's ``/metrics`` and ``/status`` and the plugin's ``/dp/status``."""

from __future__ import annotations

import asyncio
import json
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from bench.sim_vllm import SimAsyncLLM
from exporter.client.inprocess.elastic_ep import LOCAL_TARGET, UNSUPPORTED
from exporter.inprocess.vllm_facts import SCALING_MODULE
from exporter.protocol.elastic_ep import ELASTIC_EP_PHASES
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING
from exporter.web.app import RunningService
from tests.harness.inprocess import (
    CALL_TIMEOUT,
    EmbeddedExporters,
    SimVllm,
    fresh_poll,
    http_session,
)
from tests.harness.plugin_app import PluginApps
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.statusschema import validate_status

PHASE_FAMILY = "vllm_dp_elastic_ep_operation"


@dataclass
class ElasticLLM(SimAsyncLLM):
    """The simulated ``AsyncLLM`` with vLLM 0.33's ``get_external_elastic_ep_status``: it
    answers ``status`` (a map, None: no external elastic EP), raises it when it is an
    exception, or waits until ``release`` while ``hang`` is set; ``most_waiting``: the most
    calls that waited at once."""

    status: Any = None
    hang: bool = False
    waiting: list[asyncio.Event] = field(default_factory=list)
    most_waiting: int = 0

    async def get_external_elastic_ep_status(self) -> Any:
        if self.hang:
            event = asyncio.Event()
            self.waiting.append(event)
            self.most_waiting = max(self.most_waiting, sum(not e.is_set() for e in self.waiting))
            try:
                await event.wait()
            finally:
                event.set()  # cancelled by the exporter's deadline: no longer waiting
        if isinstance(self.status, BaseException):
            raise self.status
        return self.status

    def release(self) -> None:
        self.hang = False
        for event in self.waiting:
            event.set()


def elastic_llm(sim: SimVllm, status: Any = None) -> ElasticLLM:
    return ElasticLLM(sim.llm.engine_core, sim.llm.vllm_config, status=status)


def store(phase: str, epoch: str | None = None, error: str | None = None, size: int | None = None):
    """What vLLM 0.33's ``ExternalElasticEPCoordinator.get_status`` returns."""
    return {"phase": phase, "epoch": epoch, "error": error, "requested_data_parallel_size": size}


async def read(service: RunningService) -> dict[str, Any]:
    """The one target's series ({} when absent), epoch and size samples, ``/status`` entry,
    and every engine's ``is_sleeping`` outcome."""
    async with http_session() as session:
        async with session.get(service.url + "/metrics") as resp:
            assert resp.status == 200
            m = parse_metrics(await resp.text())
        async with session.get(service.url + "/status") as resp:
            assert resp.status == 200
            doc = await resp.json()
    validate_status(doc)
    [entry] = doc["elastic_ep_operations"]
    phases = {
        p: metric_value(m, PHASE_FAMILY, target=LOCAL_TARGET, phase=p) for p in ELASTIC_EP_PHASES
    }
    return {
        "phases": {p: v for p, v in phases.items() if v is not None},
        "epoch": metric_value(m, "vllm_dp_elastic_ep_epoch", target=LOCAL_TARGET),
        "size": metric_value(
            m, "vllm_dp_elastic_ep_requested_data_parallel_size", target=LOCAL_TARGET
        ),
        "entry": entry,
        "sleeping": {e["invariants"]["is_sleeping"]["outcome"] for e in doc["engines"]},
    }


async def after_polls(service: RunningService) -> dict[str, Any]:
    """Two fresh polls (the read lands beside the first's reads), then what they show."""
    await fresh_poll(service)
    await fresh_poll(service)
    return await read(service)


def one_hot(phase: str) -> dict[str, float]:
    return {p: 1.0 if p == phase else 0.0 for p in ELASTIC_EP_PHASES}


async def test_the_operation_moves_through_its_phases(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    llm = elastic_llm(sim_vllm, store("idle"))
    service = await embedded(llm)
    found = await after_polls(service)
    assert found["phases"] == one_hot("idle") and found["entry"]["target"] == LOCAL_TARGET
    for phase, scaling in (("preparing", True), ("committing", True), ("completed", False)):
        llm.status = store(phase, epoch="17", size=4)
        found = await after_polls(service)
        assert found["phases"] == one_hot(phase)
        assert (found["epoch"], found["size"]) == (17.0, 4.0)
        entry = found["entry"]
        assert (entry["phase"], entry["scaling"], entry["problem"]) == (phase, scaling, None)
        assert found["sleeping"] == {"ok"}
    llm.status = store("failed", epoch="a1b2", error="commit timed out", size=4)
    found = await after_polls(service)
    assert found["phases"] == one_hot("failed") and found["epoch"] is None
    assert (found["entry"]["error"], found["entry"]["epoch"]) == ("commit timed out", "a1b2")
    assert found["sleeping"] == {"ok"}


async def test_without_external_elastic_ep_the_process_flag_is_read(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """None from vLLM: its route then answers the process-local flag (committing / idle); a
    process that never loaded vLLM's middleware is not scaling."""
    llm = elastic_llm(sim_vllm, None)
    service = await embedded(llm)
    assert (await after_polls(service))["phases"] == one_hot("idle")
    middleware = types.ModuleType(SCALING_MODULE)
    flag = {"scaling": True}
    middleware.get_scaling_elastic_ep = lambda: flag["scaling"]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, SCALING_MODULE, middleware)
    found = await after_polls(service)
    assert found["phases"] == one_hot("committing") and found["entry"]["scaling"] is True
    assert found["entry"]["epoch"] is None and found["size"] is None
    flag["scaling"] = False
    assert (await after_polls(service))["phases"] == one_hot("idle")


async def test_an_engine_client_without_the_method_is_unsupported(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    """vLLM 0.32's ``AsyncLLM`` (the plain simulated one): no series, said once in
    ``/status``, the polls as ever."""
    service = await embedded(sim_vllm.llm)
    found = await after_polls(service)
    assert found["phases"] == {} and found["epoch"] is None
    entry = found["entry"]
    assert (entry["supported"], entry["phase"], entry["problem"]) == (False, None, UNSUPPORTED)
    assert found["sleeping"] == {"ok"}


async def test_a_failing_or_hanging_read_is_a_problem_and_never_delays_the_polls(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    llm = elastic_llm(sim_vllm, RuntimeError("the TCP store is unreachable"))
    service = await embedded(llm)
    found = await after_polls(service)
    assert found["phases"] == {}
    assert found["entry"]["problem"] == (
        "temporarily unavailable: RuntimeError: the TCP store is unreachable"
    )
    assert found["entry"]["supported"] is True and found["sleeping"] == {"ok"}

    llm.status, llm.hang = store("committing"), True
    for _ in range(3):
        await fresh_poll(service)
        assert service.exporter.poller.snapshot.poll_duration_s < CALL_TIMEOUT
    await asyncio.sleep(CALL_TIMEOUT + 0.1)
    found = await read(service)
    assert found["entry"]["problem"] == (
        f"no answer from get_external_elastic_ep_status() within {CALL_TIMEOUT:g}s"
    )
    assert found["phases"] == {} and found["sleeping"] == {"ok"}
    assert llm.most_waiting == 1  # one call at a time, however many polls meanwhile
    llm.release()
    assert (await after_polls(service))["phases"] == one_hot("committing")


HOSTILE = {
    "not_a_map": (["failed"], "answer is list, not a JSON object"),
    "phase_a_number": (store("idle") | {"phase": 3}, "phase is int"),
    "nested": (store("idle") | {"error": {"a": [[1]]}}, "error is dict"),
    "size_a_string": (store("preparing", size="4"), "requested_data_parallel_size is str"),  # type: ignore[arg-type]
}


@pytest.mark.parametrize(("status", "why"), HOSTILE.values(), ids=HOSTILE.keys())
async def test_a_status_of_another_shape_is_unreadable(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, status: Any, why: str
) -> None:
    llm = elastic_llm(sim_vllm, status)
    service = await embedded(llm)
    found = await after_polls(service)
    assert found["phases"] == {}
    problem = found["entry"]["problem"]
    assert problem.startswith("unreadable status from get_external_elastic_ep_status(): ")
    assert why in problem and found["sleeping"] == {"ok"}


async def test_huge_strings_are_cut_and_an_unknown_phase_is_other(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    llm = elastic_llm(sim_vllm, store("draining", epoch="e" * 10**6, error="x" * (10 << 20)))
    service = await embedded(llm)
    found = await after_polls(service)
    assert found["phases"] == one_hot("other")
    entry = found["entry"]
    assert entry["reported_phase"] == "draining"
    for text in (entry["epoch"], entry["error"]):
        assert CUT_MARKER in text and len(text.encode()) <= MAX_ENGINE_STRING
    assert len(json.dumps(entry)) < 2048


async def test_the_plugin_s_status_carries_it(sim_vllm: SimVllm, plugin_apps: PluginApps) -> None:
    llm = elastic_llm(sim_vllm, store("committing", epoch="5", size=3))
    app = await plugin_apps.bare(llm)
    exporter = app.runtime.exporter
    assert exporter is not None
    for _ in range(2):
        after = exporter.poller.snapshot.poll_number
        exporter.poller.poll_soon()
        await exporter.poller.wait_for_poll(after + 1, 5.0)
    status, doc = await app.get_json("/dp/status")
    assert status == 200
    validate_status(doc)
    [entry] = doc["elastic_ep_operations"]
    assert (entry["target"], entry["phase"], entry["epoch"]) == (LOCAL_TARGET, "committing", "5")
    text = await app.metrics()
    m = parse_metrics(text)
    assert metric_value(m, PHASE_FAMILY, target=LOCAL_TARGET, phase="committing") == 1.0
    assert (
        metric_value(m, "vllm_dp_elastic_ep_requested_data_parallel_size", target=LOCAL_TARGET)
        == 3.0
    )
