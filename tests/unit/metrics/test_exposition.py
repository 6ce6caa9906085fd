"""The fast text renderer is byte-identical to prometheus_client's generate_latest."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest

from exporter.base.steps import run_steps
from exporter.client.fake import FakeFleet
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.config.settings import resolve_config
from exporter.control.runtime import Exporter
from exporter.metrics.exposition import text_steps
from exporter.metrics.stats import Stats


def fixed(engine: str, method: str, args: tuple[object, ...]) -> object:
    """Fixed answers: the renderer is what is under test here."""
    if engine == "2":
        return EngineOutcome("2", Outcome.TIMEOUT, error="no reply", duration_s=1.0)
    return {"0": True, "1": False}[engine]


async def test_render_text_equals_generate_latest() -> None:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=3,
        handshake_address="tcp://127.0.0.1:1",
        model_name='m"x\\y\nz',
        admin_listen="off",
    )
    fleet = FakeFleet(fixed, engines=("0", "1", "2"), disconnected=set())
    fleet.vllm_version = '0.33"odd\\version\n'
    exporter = Exporter(config, client=fleet)
    await exporter.poller.poll_once()
    stats: Stats = exporter.stats
    stats.record_reset("partial_failure", [("1", "refused"), ("1", "refused")], 0.3, 1.5e9)
    stats.record_admin_request("reset_prefix_cache", 502)
    exporter.faults.record("not_msgpack", "x")
    expected = generate_latest(exporter.registry)
    assert run_steps(text_steps(exporter.collector.families())) == expected
    assert b'model_name="m\\"x\\\\y\\nz"' in expected
