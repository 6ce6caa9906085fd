"""Every utility call the exporter sends is counted in ``vllm_dp_utility_calls_total``, whichever
path sends it (the poller, the gate, an admin action and its read-back): what each engine
received equals what the exporter counted for it, method by method."""

from __future__ import annotations

from collections import Counter
from typing import Any

from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually
from tests.integration.rl.test_rl_owner import gate, post

ACTIONS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("sleep", {"params": {"level": "1"}}),
    ("wake_up", {}),
    ("pause", {}),
    ("resume", {}),
    ("weight_version", {"json": {"weight_version": "step-9"}}),
    ("reset_prefix_cache", {}),
    ("reset_mm_cache", {}),
    ("reset_encoder_cache", {}),
    ("verify_weights", {}),
)


def received(svc: Service) -> Counter[tuple[str, str]]:
    """(method, engine) → utility calls that engine received."""
    return Counter((method, str(e.engine_index)) for e in svc.engines for method, _ in e.received)


def counted(svc: Service) -> Counter[tuple[str, str]]:
    """(method, engine) → utility calls the exporter counted as sent (any outcome but
    ``disconnected``: the first polls, before the handshakes, are counted but never sent)."""
    totals: Counter[tuple[str, str]] = Counter()
    for (method, engine, outcome), n in svc.exporter.stats.utility_calls.items():
        if outcome != "disconnected":
            totals[(method, engine)] += n
    return +totals


async def test_gate_and_admin_calls_are_counted_like_polls(rl_fleet: ServiceFactory) -> None:
    # vLLM 0.34's engines: every polled method answered (an unsupported answer is no call
    # outcome, so it is not counted: test_rl_owner.py).
    options = SimOptions(weight_version="v1", vllm_version="0.34.0")
    svc = await rl_fleet(2, options=options, gate_min_interval=0.0)
    for _ in range(10):
        status, _ = await gate(svc, weight_version="v1")
        assert status == 200
    for action, kwargs in ACTIONS:
        status, body = await post(svc, action, **kwargs)
        assert status == 200, (action, body)
    await eventually(lambda: counted(svc) == received(svc), 5, "every call counted")
    methods = {method for method, _ in received(svc)}
    assert {"sleep", "wake_up", "pause_scheduler", "set_weight_version"} <= methods
    m = await svc.scrape()
    for method in ("wake_up", "compute_weight_checksums", "reset_mm_cache"):
        assert metric_value(
            m, "vllm_dp_utility_calls_total", method=method, engine="1", outcome="ok"
        ), method
    # The read-back and gate calls are in the same series as the poller's.
    sleeping = metric_value(
        m, "vllm_dp_utility_calls_total", method="is_sleeping", engine="0", outcome="ok"
    )
    assert sleeping is not None and sleeping >= svc.exporter.stats.polls + 10
