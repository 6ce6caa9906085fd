"""The fast text renderer is byte-identical to prometheus_client's generate_latest."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest

from exporter.config import resolve_config
from exporter.exposition import render_text
from exporter.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.runtime import Exporter
from exporter.stats import Stats


class _FixedClient:
    """A FleetClient double with fixed answers: the renderer is what is under test here."""

    engine_labels = ["0", "1", "2"]

    def engine_details(self):  # type: ignore[no-untyped-def]

        return [
            EngineDetail("0", True, "tcp://a", '0.33"odd\\version\n', True),
            EngineDetail("1", True, "tcp://b", "0.33.0", False),
            EngineDetail("2", False, "tcp://c"),
        ]

    def connected_count(self) -> int:
        return 2

    def supports(self, method: str) -> bool:
        return True

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def call_utility(self, method, args=(), *, timeout_s):  # type: ignore[no-untyped-def]
        return [
            EngineOutcome("0", Outcome.OK, True, duration_s=0.001),
            EngineOutcome("1", Outcome.OK, False, duration_s=0.02),
            EngineOutcome("2", Outcome.TIMEOUT, error="no reply", duration_s=1.0),
        ]


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
    exporter = Exporter(config, client=_FixedClient())  # type: ignore[arg-type]
    await exporter.poller.poll_once()
    stats: Stats = exporter.stats
    stats.resets["partial_failure"] += 1
    stats.reset_engine_failures[("1", "refused")] += 2
    stats.reset_durations.observe(0.3)
    stats.last_reset_success_unix = 1.5e9
    stats.admin_requests[("reset_prefix_cache", "502")] += 1
    exporter.errors.record("not_msgpack", "x")
    expected = generate_latest(exporter.registry)
    assert render_text(exporter.collector.families()) == expected
    assert b'model_name="m\\"x\\\\y\\nz"' in expected
