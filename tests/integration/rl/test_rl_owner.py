"""RL invariants over real sockets, owner mode: weight versions polled per rank, the gate,
collective actions verified by reading the state back, weight checksums across ranks.

Simulated engines speak the real protocol over ZMQ on loopback; the exporter is served over
real HTTP; every wait is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually


async def post(svc: Service, action: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/{action}", **kwargs) as resp:
        return resp.status, await resp.json()


async def gate(svc: Service, **params: str) -> tuple[int, dict[str, Any]]:
    async with svc.session.get(f"{svc.url}/gate", params=params) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return resp.status, await resp.json()


def reasons(body: dict[str, Any]) -> dict[int, str | None]:
    return {e["engine"]: e["reason"] for e in body["engines"]}


async def test_weight_versions_are_polled_per_rank(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(3, options=SimOptions(weight_version="v1"))
    await svc.next_polls()
    m = await svc.scrape()
    assert metric_value(m, "vllm_dp_weight_version_consistent") == 1.0
    for i in range(3):
        info = metric_value(
            m, "vllm_dp_engine_weight_version_info", engine=str(i), weight_version="v1"
        )
        assert info == 1.0
    svc.engines[2].state.weight_version = "v2"
    await svc.next_polls()
    m = await svc.scrape()
    assert metric_value(m, "vllm_dp_weight_version_consistent") == 0.0
    counted = metric_value(
        m, "vllm_dp_inconsistent_utility_results_total", method="get_weight_version"
    )
    assert counted is not None and counted >= 1
    status = await svc.status()
    weights = status["aggregate"]["get_weight_version"]
    assert weights["state"] == "inconsistent" and weights["values"] == ["v1", "v1", "v2"]
    versions = [e["invariants"]["get_weight_version"]["value"] for e in status["engines"]]
    assert versions == ["v1", "v1", "v2"]


async def test_an_engine_without_get_weight_version_is_unsupported_not_failing(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(
        2,
        options=SimOptions(weight_version="v1"),
        per_engine={"missing_methods": {1: frozenset({"get_weight_version"})}},
    )
    await svc.next_polls(3)
    asked = len(svc.engines[1].args_of("get_weight_version"))
    await svc.next_polls(2)
    assert len(svc.engines[1].args_of("get_weight_version")) == asked == 1
    m = await svc.scrape()
    assert metric_value(m, "vllm_dp_weight_version_consistent") == 1.0
    assert not metric_value(
        m, "vllm_dp_utility_calls_total", method="get_weight_version", engine="1", outcome="failed"
    )
    status = await svc.status()
    assert status["engines"][1]["unsupported"] == ["checkpoint_state", "get_weight_version"]


async def test_gate_holds_only_when_every_rank_meets_every_condition(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(3, options=SimOptions(weight_version="v7"), gate_min_interval=0.0)
    status, body = await gate(svc, weight_version="v7", sleeping="false", paused="false")
    assert status == 200 and body["ok"] is True and body["failing_engines"] == []
    svc.engines[1].state.weight_version = "v6"
    svc.engines[2].state.paused = True
    status, body = await gate(svc, weight_version="v7", paused="false")
    assert status == 412 and body["failing_engines"] == ["1", "2"]
    failures = {e["engine"]: e["failures"] for e in body["engines"]}
    assert failures["1"] == ["weight_version is 'v6', expected 'v7'"]
    assert failures["2"] == ["paused is True, expected False"]
    status, body = await gate(svc, bogus="1")
    assert status == 400 and "bogus" in body["error"]


async def test_inference_ready_is_asked_only_by_the_gate_that_needs_it(
    rl_fleet: ServiceFactory,
) -> None:
    """vLLM 0.34's ``is_inference_ready`` is a collective RPC to the workers: the polls never
    send it, a gate with ``inference_ready`` asks it of every engine (a paused one named), and a
    fleet whose engines all lack it (an older vLLM) answers 501."""
    svc = await rl_fleet(3, gate_min_interval=0.0)
    await svc.fresh_poll()
    await svc.fresh_poll()
    assert all("is_inference_ready" not in e.calls_by_method for e in svc.engines)
    status, body = await gate(svc, inference_ready="true")
    assert status == 200 and body["failing_engines"] == [], body
    assert all(e.calls_by_method["is_inference_ready"] == 1 for e in svc.engines)
    svc.engines[2].state.paused = True
    status, body = await gate(svc, inference_ready="true")
    assert status == 412 and body["failing_engines"] == ["2"]
    (failure,) = next(e for e in body["engines"] if e["engine"] == "2")["failures"]
    assert failure == "inference_ready is False, expected True"
    await svc.fresh_poll()
    assert all(e.calls_by_method["is_inference_ready"] == 2 for e in svc.engines)  # polls: none
    old = await rl_fleet(
        2,
        gate_min_interval=0.0,
        per_engine={
            "missing_methods": {
                0: frozenset({"is_inference_ready"}),
                1: frozenset({"is_inference_ready"}),
            }
        },
    )
    status, body = await gate(old, inference_ready="true")
    assert status == 501 and body["unsupported"] == ["inference_ready"], body


async def test_gate_fan_out_is_fresh_and_shared(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(2, options=SimOptions(weight_version="a"), gate_min_interval=5.0)
    the_gate = svc.exporter.gate
    results = await asyncio.gather(*(gate(svc, weight_version="a") for _ in range(20)))
    assert all(status == 200 for status, _ in results)
    assert the_gate.fanouts == 1, "concurrent callers share one fresh fan-out"
    svc.engines[0].state.weight_version = "b"
    status, _ = await gate(svc, weight_version="a")
    assert status == 200, "within the minimum interval the shared sample is reused"
    the_gate._min_interval_s = 0.0
    status, body = await gate(svc, weight_version="a")
    assert status == 412 and body["failing_engines"] == ["0"]


async def test_gate_without_engines_is_503(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(2, start=False)
    status, body = await gate(svc, sleeping="false")
    assert status == 503 and body["ok"] is False


async def test_sleep_wake_pause_resume_are_verified_on_every_engine(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(3)
    status, body = await post(svc, "sleep", params={"level": "1"})
    assert status == 200 and body["success"] and body["verified"], body
    assert all(e["state"] is True for e in body["engines"])
    assert all(engine.state.sleeping_tags for engine in svc.engines)
    status, body = await post(svc, "wake_up")
    assert status == 200 and all(e["state"] is False for e in body["engines"]), body
    status, body = await post(svc, "pause", params={"mode": "keep"})
    assert status == 200 and all(engine.state.paused for engine in svc.engines)
    assert [engine.state.pause_clear_cache for engine in svc.engines] == [True] * 3  # vLLM's
    status, body = await post(svc, "pause", params={"mode": "keep", "clear_cache": "false"})
    assert status == 200 and body["params"] == {"mode": "keep", "clear_cache": False}, body
    assert [engine.state.pause_clear_cache for engine in svc.engines] == [False] * 3
    status, body = await post(svc, "resume")
    assert status == 200 and not any(engine.state.paused for engine in svc.engines)
    status, body = await post(svc, "weight_version", json={"weight_version": "step-3"})
    assert status == 200 and [e["state"] for e in body["engines"]] == ["step-3"] * 3
    m = await svc.scrape()
    for action in ("sleep", "wake_up", "pause", "resume", "weight_version"):
        done = 2 if action == "pause" else 1
        assert metric_value(m, "vllm_dp_admin_actions_total", action=action, outcome="success") == (
            done
        )


async def test_an_engine_that_accepts_but_does_not_change_state_fails_as_unverified(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(3, per_engine={"ignore_state_changes": {0: True}})
    status, body = await post(svc, "sleep")
    assert status == 502 and body["outcome"] == "partial_failure"
    assert reasons(body) == {0: "unverified", 1: None, 2: None}
    assert "is_sleeping is False" in body["engines"][0]["error"]
    assert body["failed_engines"] == [0]
    m = await svc.scrape()
    failures = metric_value(
        m,
        "vllm_dp_admin_action_engine_failures_total",
        action="sleep",
        engine="0",
        reason="unverified",
    )
    assert failures == 1.0


async def test_an_engine_lacking_the_method_is_unsupported(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(2, per_engine={"missing_methods": {1: frozenset({"reset_mm_cache"})}})
    status, body = await post(svc, "reset_mm_cache")
    assert status == 502 and reasons(body) == {0: None, 1: "unsupported"}


async def test_bad_action_requests_are_400_and_reach_no_engine(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(2)
    for action, kwargs in (
        ("sleep", {"params": {"level": "9"}}),
        ("pause", {"params": {"mode": "nap"}}),
        ("weight_version", {"data": b"not json"}),
        ("weight_version", {"json": {"weight_version": ""}}),
        ("resume", {"params": {"x": "1"}}),
    ):
        status, body = await post(svc, action, **kwargs)
        assert status == 400, (action, body)
    for engine in svc.engines:
        assert not engine.args_of("sleep") and not engine.args_of("pause_scheduler")


async def test_weights_compared_across_ranks_name_the_corrupted_engine(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(
        3,
        options=SimOptions(weight_version="v1"),
        per_engine={"corrupt_param": {2: "model.layers.0.mlp.down_proj.weight"}},
    )
    status, body = await post(svc, "verify_weights")
    assert status == 502, body
    by_engine = {e["engine"]: e for e in body["engines"]}
    assert by_engine[2]["reason"] == "mismatch" and by_engine[2]["mismatches"] >= 1
    assert any(
        "model.layers.0.mlp.down_proj.weight" in p for p in by_engine[2]["mismatching_parameters"]
    )
    assert by_engine[0]["agrees_with_majority"] and by_engine[1]["agrees_with_majority"]
    m = await svc.scrape()
    assert metric_value(m, "vllm_dp_weight_checksum_mismatches", engine="2") >= 1  # type: ignore[operator]
    assert metric_value(m, "vllm_dp_weight_checksum_mismatches", engine="0") == 0.0


async def test_actions_share_one_flight(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(2, action_timeout=1.0)
    svc.engines[1].options.hang = True  # the sleep waits for its timeout on this engine
    first = asyncio.create_task(post(svc, "sleep"))
    await eventually(
        lambda: svc.engines[1].calls_by_method.get("sleep", 0) > 0, what="sleep sent to 1"
    )
    status, body = await post(svc, "resume")
    assert status == 409 and "sleep" in body["error"]
    status, body = await first
    assert status == 502 and reasons(body) == {0: None, 1: "timeout"}


async def test_the_gate_never_answers_from_before_an_action(rl_fleet: ServiceFactory) -> None:
    """A gate sample taken before an admin action is not reused after it, whatever the
    minimum interval (the RL script runs the gate right after setting the version)."""
    svc = await rl_fleet(2, options=SimOptions(weight_version="old"), gate_min_interval=30.0)
    status, _ = await gate(svc, weight_version="new")
    assert status == 412
    status, _ = await post(svc, "weight_version", json={"weight_version": "new"})
    assert status == 200
    status, body = await gate(svc, weight_version="new")
    assert status == 200, body


async def test_waking_every_tag_is_verified_like_a_full_wake_up(rl_fleet: ServiceFactory) -> None:
    """vLLM wakes everything when every tag is named: the read-back then applies, as it does
    for a wake-up without tags; a wake-up of some tags has no single state to read back."""
    svc = await rl_fleet(2)
    for tags in ({"tags": "weights,kv_cache"}, [("tags", "kv_cache"), ("tags", "weights")]):
        status, body = await post(svc, "sleep", params={"level": "1"})
        assert status == 200, body
        status, body = await post(svc, "wake_up", params=tags)
        assert status == 200 and body["verified"] is True, body
        assert [e["state"] for e in body["engines"]] == [False, False]
        assert body["params"] == {"tags": ["kv_cache", "weights"]}
        assert all(e.args_of("wake_up")[-1] == [["kv_cache", "weights"]] for e in svc.engines)
    # An engine that accepts the wake-up of every tag but stays asleep is caught.
    await post(svc, "sleep", params={"level": "1"})
    svc.engines[1].state.ignore_state_changes = True
    status, body = await post(svc, "wake_up", params={"tags": "weights,kv_cache"})
    assert status == 502 and reasons(body) == {0: None, 1: "unverified"}, body
    # Some tags only: answered without a read-back.
    svc.engines[1].state.ignore_state_changes = False
    await post(svc, "sleep", params={"level": "1"})
    status, body = await post(svc, "wake_up", params={"tags": "weights"})
    assert status == 200 and body["verified"] is False, body
