"""The metric catalog, the docs and a live exporter agree on every metric name.

docs/metrics.md is generated from exporter/metrics/catalog.py (tools/gen_metrics_doc.py);
tests/data/design_metrics.txt is the product contract's metric table (docs/design.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest
import zmq
import zmq.asyncio

from exporter.base.ports import free_port_range
from exporter.metrics.catalog import BY_NAME, METRICS, PREFIX, MetricSpec, sample_names
from exporter.protocol.pushes import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    encode_ft_status_value,
)
from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS
from tests.harness.processes import ROOT
from tests.harness.scrape import metric_value as value
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually

METRICS_DOC = ROOT / "docs" / "metrics.md"
DESIGN_METRICS = ROOT / "tests" / "data" / "design_metrics.txt"
_ROW = re.compile(r"^\| `(vllm_dp_[a-z0-9_]+)` \| (\w+) \| ([^|]*) \|")


def doc_rows() -> dict[str, tuple[str, tuple[str, ...]]]:
    """name → (type, labels) from the table of docs/metrics.md."""
    rows: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in METRICS_DOC.read_text().splitlines():
        match = _ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} listed twice in docs/metrics.md"
            rows[name] = (kind, tuple(re.findall(r"`([a-z_]+)`", labels)))
    return rows


def design_names() -> list[str]:
    lines = DESIGN_METRICS.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def all_sample_names() -> set[str]:
    return {n for spec in METRICS for n in (spec.name, *sample_names(spec))}


def test_metrics_doc_lists_exactly_the_catalog() -> None:
    rows = doc_rows()
    assert set(rows) == set(BY_NAME), "docs/metrics.md and the catalog list different metrics"
    for spec in METRICS:
        assert rows[spec.name] == (spec.kind, spec.labels), spec.name


@pytest.mark.slow
def test_metrics_doc_is_the_generator_output() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gen_metrics_doc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr


def test_design_metrics_are_in_the_catalog() -> None:
    names = design_names()
    assert len(names) >= 17
    assert set(names) <= set(BY_NAME), set(names) - set(BY_NAME)


def test_every_metric_name_in_the_docs_exists() -> None:
    """No page (README.md included, when present) names a metric the exporter lacks."""
    pages = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
    known = all_sample_names()
    checked = 0
    for page in pages:
        if not page.exists():
            continue
        checked += 1
        # A name followed by ".ext" is a file (vllm_dp_exporter.reading.json), not a metric.
        named = re.findall(r"\bvllm_dp_[a-z0-9_]+\b(?!\.[a-z])", page.read_text())
        unknown = set(named) - known
        assert not unknown, f"{page.relative_to(ROOT)} names unknown metrics {sorted(unknown)}"
    assert checked >= 1


def catalog_family(spec: MetricSpec) -> str:
    """The family name prometheus_client's parser reports for a spec."""
    return spec.family


async def send_garbage_to_output_socket(fleet: Service) -> None:
    """A protocol error: an undecodable frame on engine 0's output PULL socket."""
    address = fleet.exporter.client.engine_details()[0].address
    assert address.startswith("tcp://127.0.0.1:")
    push = fleet.context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    try:
        await push.send(b"\xc1 this is not msgpack")
        await eventually(lambda: bool(fleet.exporter.faults.counts), what="a protocol error")
    finally:
        push.close(linger=0)


def families_with_samples(families: dict[str, Any]) -> set[str]:
    return {name for name, f in families.items() if f.samples}


async def test_live_exporter_exports_every_catalog_and_design_metric(
    fleet_factory: ServiceFactory,
) -> None:
    # vLLM 0.34's engines (the checkpoint state) and the ZMQ load publisher on (its series).
    publisher = f"tcp://127.0.0.1:{free_port_range(2)}"
    fleet = await fleet_factory(
        2, options=SimOptions(vllm_version="0.34.0"), load_publisher=publisher
    )
    seen: set[str] = set()
    scraped: set[str] = set()

    async def scrape() -> dict[str, Any]:
        m = await fleet.scrape()
        seen.update(families_with_samples(m))
        scraped.update(name for name in m if name.startswith(PREFIX))
        return m

    m = await scrape()  # consistent and awake: vllm_dp_sleeping has a sample now
    assert value(m, "vllm_dp_sleeping") == 0.0

    # A successful reset, then one refused by engine 1 (partial failure).
    status, _, _ = await fleet.reset()
    assert status == 200
    fleet.engines[1].state.refuse_reset = True
    status, _, _ = await fleet.reset()
    assert status == 502
    # A weight verification (engines agree: every engine's mismatch count is 0).
    assert fleet.admin_url is not None
    async with fleet.session.post(fleet.admin_url + "/admin/verify_weights") as resp:
        assert resp.status == 200, await resp.text()
    # Pushes: a fault-tolerance status and an elastic-EP notification (vLLM 0.33's payloads).
    await fleet.engines[0].push(FT_STATUS_CALL_ID, encode_ft_status_value(0, "unhealthy", "E"))
    await fleet.engines[1].push(EEP_NOTIFICATION_CALL_ID, ["RECONFIGURE_FINISHED", 1])
    # A protocol error and an inconsistency.
    await send_garbage_to_output_socket(fleet)
    fleet.engines[0].state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    m = await scrape()
    assert value(m, "vllm_dp_sleep_state_consistent") == 0.0
    kinds = {s.labels["kind"]: s.value for s in m["vllm_dp_protocol_errors"].samples}
    assert kinds == fleet.exporter.faults.counts and sum(kinds.values()) >= 1
    assert value(m, "vllm_dp_fault_tolerance_faulty_engines") == 1.0

    expected = {catalog_family(s) for s in METRICS if "owner" in s.modes}
    missing = expected - seen
    assert not missing, f"catalog metrics never exported with samples: {sorted(missing)}"
    relay_only = {catalog_family(s) for s in METRICS if "owner" not in s.modes}
    assert relay_only, "the catalog has a relay-only metric"
    assert not relay_only & scraped, "relay-only metrics exported outside relay mode"

    design = {catalog_family(BY_NAME[n]) for n in design_names()}
    assert design <= seen, f"design metrics not exported: {sorted(design - seen)}"

    # And the other way round: every vllm_dp_ family scraped is in the catalog.
    catalog = {catalog_family(s) for s in METRICS}
    assert scraped <= catalog, f"exported but not in the catalog: {sorted(scraped - catalog)}"
    for name in scraped:
        spec = next(s for s in METRICS if catalog_family(s) == name)
        for s in m[name].samples:
            labels = set(s.labels) - {"le"}
            assert labels == set(spec.labels), (name, s.labels)
