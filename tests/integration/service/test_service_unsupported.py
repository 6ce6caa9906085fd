"""Something no engine supports is its own outcome, over real HTTP and real ZMQ (owner mode,
simulated engines): an admin action every engine lacks, or ``sleep``/``wake_up`` when every
engine registered without sleep mode (then never sent), answers 501 ``unsupported`` (counted,
replayed for its Idempotency-Key, ``exporter.remote.Unsupported``, ``ctl`` exit 4); a mix stays
a 502 partial failure naming the unsupported engines (``ctl`` exit 2); a gate condition no
engine can answer is 501 at once, for ``GET /gate``, ``Client.wait`` and ``ctl wait``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from multidict import CIMultiDictProxy

from exporter.remote import Client, PartialFailure, Unsupported
from exporter.sim.options import SimOptions
from tests.harness.processes import run_cli
from tests.harness.scrape import metric_value as value
from tests.harness.service import Service, ServiceFactory

Answer = tuple[int, dict[str, Any], CIMultiDictProxy[str]]
NO_SLEEP = SimOptions(enable_sleep_mode=False)
POSITIONS = {"first": 0, "middle": 1, "last": 2}


async def post(
    svc: Service,
    action: str,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    **params: str,
) -> Answer:
    assert svc.admin_url is not None
    async with svc.session.post(
        f"{svc.admin_url}/admin/{action}", params=params, json=body, headers=headers or {}
    ) as resp:
        return resp.status, await resp.json(), resp.headers


def sent(svc: Service, method: str) -> list[int]:
    return [e.calls_by_method.get(method, 0) for e in svc.engines]


#: (action, the engine method it calls, JSON body)
MISSING = [
    ("reset_mm_cache", "reset_mm_cache", None),
    ("reset_encoder_cache", "reset_encoder_cache", None),
    ("reset_prefix_cache", "reset_prefix_cache", None),
    ("pause", "pause_scheduler", None),
    ("weight_version", "set_weight_version", {"weight_version": "v2"}),
]


@pytest.mark.parametrize(("action", "method", "body"), MISSING, ids=[m[0] for m in MISSING])
async def test_an_action_every_engine_lacks_is_501_unsupported(
    fleet_factory: ServiceFactory, action: str, method: str, body: dict[str, Any] | None
) -> None:
    fleet = await fleet_factory(3, options=SimOptions(missing_methods=frozenset({method})))
    status, answer, _ = await post(fleet, action, body)
    assert status == 501, answer
    assert answer["success"] is False and answer["outcome"] == "unsupported"
    assert [(e["engine"], e["ok"], e["reason"]) for e in answer["engines"]] == [
        (i, False, "unsupported") for i in range(3)
    ]
    assert all(method in (e["error"] or "") for e in answer["engines"]), answer
    assert answer["failed_engines"] == [0, 1, 2]
    assert sent(fleet, method) == [1, 1, 1]  # asked: the engine itself said it has no such method
    m = await fleet.scrape()
    assert value(m, "vllm_dp_admin_requests", action=action, code="501") == 1.0
    if action == "reset_prefix_cache":
        assert value(m, "vllm_dp_prefix_cache_resets", outcome="unsupported") == 1.0
        assert value(m, "vllm_dp_prefix_cache_resets", outcome="failure") == 0.0
    else:
        assert value(m, "vllm_dp_admin_actions", action=action, outcome="unsupported") == 1.0
        assert value(m, "vllm_dp_admin_actions", action=action, outcome="failure") in (None, 0.0)
        for engine in "012":
            assert (
                value(
                    m,
                    "vllm_dp_admin_action_engine_failures",
                    action=action,
                    engine=engine,
                    reason="unsupported",
                )
                == 1.0
            )
    last = (await fleet.status())["last_action"]
    assert last["action"] == action and last["status"] == 501, last


async def test_sleep_and_wake_up_are_never_sent_to_engines_without_sleep_mode(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(3, options=NO_SLEEP)
    for action in ("sleep", "wake_up"):
        status, answer, _ = await post(fleet, action)
        assert status == 501, answer
        assert answer["outcome"] == "unsupported"
        assert [e["reason"] for e in answer["engines"]] == ["unsupported"] * 3
        assert all("--enable-sleep-mode" in e["error"] for e in answer["engines"]), answer
    assert sent(fleet, "sleep") == [0, 0, 0] and sent(fleet, "wake_up") == [0, 0, 0]
    assert all(e.args_of("sleep") == [] for e in fleet.engines)
    assert not any(e.state.is_sleeping() for e in fleet.engines)
    m = await fleet.scrape()
    for action in ("sleep", "wake_up"):
        assert value(m, "vllm_dp_admin_actions", action=action, outcome="unsupported") == 1.0
    assert [s.labels["enable_sleep_mode"] for s in m["vllm_dp_engine_info"].samples] == [
        "false"
    ] * 3
    # Other actions are unaffected: the pause is sent and confirmed.
    status, answer, _ = await post(fleet, "pause")
    assert (status, answer["outcome"]) == (200, "success")


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_one_engine_without_sleep_mode_is_a_partial_failure_naming_it(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(3, per_engine={"enable_sleep_mode": {position: False}})
    status, answer, _ = await post(fleet, "sleep", level="1")
    assert status == 502, answer
    assert answer["outcome"] == "partial_failure" and answer["failed_engines"] == [position]
    reasons = {e["engine"]: (e["reason"], e["state"]) for e in answer["engines"]}
    others = [i for i in range(3) if i != position]
    assert reasons == {position: ("unsupported", None)} | {i: (None, True) for i in others}
    assert sent(fleet, "sleep") == [0 if i == position else 1 for i in range(3)]
    assert [e.state.is_sleeping() for e in fleet.engines] == [i != position for i in range(3)]

    status, answer, _ = await post(fleet, "wake_up")
    assert status == 502 and answer["failed_engines"] == [position], answer
    assert sent(fleet, "wake_up") == [0 if i == position else 1 for i in range(3)]
    assert not any(e.state.is_sleeping() for e in fleet.engines)
    m = await fleet.scrape()
    assert value(m, "vllm_dp_admin_actions", action="sleep", outcome="partial_failure") == 1.0
    assert value(m, "vllm_dp_admin_actions", action="sleep", outcome="unsupported") in (None, 0.0)
    failures = m["vllm_dp_admin_action_engine_failures"].samples
    assert sorted((s.labels["action"], s.labels["engine"]) for s in failures if s.value) == [
        ("sleep", str(position)),
        ("wake_up", str(position)),
    ]


async def test_a_501_is_replayed_for_its_idempotency_key(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(
        2, options=SimOptions(missing_methods=frozenset({"reset_encoder_cache"}))
    )
    key = {"Idempotency-Key": "encoder-step-9"}
    first = await post(fleet, "reset_encoder_cache", headers=key)
    second = await post(fleet, "reset_encoder_cache", headers=key)
    assert first[0] == second[0] == 501
    assert first[1] == second[1] and first[1]["outcome"] == "unsupported"
    assert "Idempotency-Replayed" not in first[2]
    assert second[2].get("Idempotency-Replayed") == "true"
    assert sent(fleet, "reset_encoder_cache") == [1, 1]  # the replay asked no engine
    third = await post(fleet, "reset_encoder_cache", headers={"Idempotency-Key": "step-10"})
    assert third[0] == 501 and "Idempotency-Replayed" not in third[2]
    assert sent(fleet, "reset_encoder_cache") == [2, 2]

    sleepless = await fleet_factory(2, options=NO_SLEEP)
    key = {"Idempotency-Key": "sleep-step-1"}
    answers = [await post(sleepless, "sleep", headers=key) for _ in range(2)]
    assert [a[0] for a in answers] == [501, 501] and answers[0][1] == answers[1][1]
    assert answers[1][2].get("Idempotency-Replayed") == "true"
    assert sent(sleepless, "sleep") == [0, 0]


async def test_a_gate_condition_no_engine_can_answer_is_501(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(
        3,
        options=SimOptions(missing_methods=frozenset({"get_weight_version"})),
        gate_min_interval=0.0,
    )
    status, body = await fleet.get_json("/gate?weight_version=v1&sleeping=false")
    assert status == 501, body
    assert body["unsupported"] == ["weight_version"] and body["ok"] is False
    assert "weight_version" in body["error"]
    status, body = await fleet.get_json("/gate?sleeping=false")
    assert status == 200, body  # the conditions the engines can answer still open the gate
    await fleet.fresh_poll()
    _, doc = await fleet.get_json("/status")
    assert doc["aggregate"]["get_weight_version"]["outcome"] == "unsupported"
    assert doc["aggregate"]["get_weight_version"]["unsupported"] == ["0", "1", "2"]
    assert doc["aggregate"]["is_sleeping"]["outcome"] == "consistent"

    # One engine of three has the method: the question can be answered, the gate is 412.
    mixed = await fleet_factory(
        3,
        options=SimOptions(weight_version="v1"),
        per_engine={"missing_methods": {1: frozenset({"get_weight_version"})}},
        gate_min_interval=0.0,
    )
    status, body = await mixed.get_json("/gate?weight_version=v1")
    assert status == 412 and body["failing_engines"] == ["1"], body
    assert "unsupported" not in body
    await mixed.fresh_poll()
    _, doc = await mixed.get_json("/status")
    verdict = doc["aggregate"]["get_weight_version"]
    assert verdict["outcome"] == "consistent" and verdict["unsupported"] == ["1"]


async def test_the_remote_client_raises_unsupported_for_the_gate_and_actions(
    fleet_factory: ServiceFactory,
) -> None:
    svc = await fleet_factory(
        3,
        options=SimOptions(
            enable_sleep_mode=False, missing_methods=frozenset({"get_weight_version"})
        ),
        gate_min_interval=0.0,
    )
    async with Client(svc.url, svc.admin_url) as dp:
        with pytest.raises(Unsupported) as gate:
            await dp.gate(weight_version="v1")
        assert gate.value.status == 501 and gate.value.conditions == ("weight_version",)
        started = time.monotonic()
        with pytest.raises(Unsupported) as waited:
            await dp.wait({"weight_version": "v1"}, 30, interval_s=0.2)
        assert time.monotonic() - started < 5, "a 501 must not be retried until the timeout"
        assert waited.value.conditions == ("weight_version",)

        with pytest.raises(Unsupported) as slept:
            await dp.sleep(level=1)
        assert not isinstance(slept.value, PartialFailure) and slept.value.status == 501
        result = slept.value.result
        assert result is not None and result.unsupported and result.outcome == "unsupported"
        assert [e.reason for e in result.engines] == ["unsupported"] * 3
        assert [e.engine for e in result.unsupported_engines] == ["0", "1", "2"]
    assert sent(svc, "sleep") == [0, 0, 0]

    mixed = await fleet_factory(3, per_engine={"enable_sleep_mode": {2: False}})
    async with Client(mixed.url, mixed.admin_url) as dp:
        with pytest.raises(PartialFailure) as partial:
            await dp.sleep(level=1)
        assert not isinstance(partial.value, Unsupported) and partial.value.status == 502
        assert not partial.value.result.unsupported
        assert [e.engine for e in partial.value.result.unsupported_engines] == ["2"]
        assert [e.ok for e in partial.value.result.engines] == [True, True, False]


@pytest.mark.slow
async def test_ctl_exits_4_when_no_engine_supports_it_and_2_for_a_mix(
    fleet_factory: ServiceFactory,
) -> None:
    svc = await fleet_factory(2, options=NO_SLEEP)
    assert svc.admin_url is not None
    code, out, err = await run_cli("ctl", "sleep", "--admin-url", svc.admin_url)
    assert code == 4, (out, err)
    assert out.splitlines()[0] == "sleep: unsupported"
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines()[2:]}
    assert rows == {"0": ["no", "unsupported"], "1": ["no", "unsupported"]}
    assert "ctl:" in err and "Traceback" not in err
    code, out, err = await run_cli("ctl", "wake-up", "--admin-url", svc.admin_url, "--json")
    assert code == 4, err
    assert json.loads(out)["outcome"] == "unsupported"
    assert sent(svc, "sleep") == [0, 0] and sent(svc, "wake_up") == [0, 0]

    mixed = await fleet_factory(3, per_engine={"enable_sleep_mode": {1: False}})
    assert mixed.admin_url is not None
    code, out, err = await run_cli("ctl", "sleep", "--admin-url", mixed.admin_url, "--json")
    assert code == 2, (out, err)
    body = json.loads(out)
    assert body["outcome"] == "partial_failure" and body["failed_engines"] == [1]
    assert body["engines"][1]["reason"] == "unsupported"


@pytest.mark.slow
async def test_ctl_wait_exits_4_at_once_for_a_condition_no_engine_supports(
    fleet_factory: ServiceFactory,
) -> None:
    svc = await fleet_factory(
        2, options=SimOptions(missing_methods=frozenset({"get_weight_version"}))
    )
    started = time.monotonic()
    wait = ("ctl", "wait", "--url", svc.url, "--weight-version", "v1", "--timeout", "60")
    code, out, err = await run_cli(*wait, timeout_s=30.0)
    elapsed = time.monotonic() - started
    assert code == 4, (code, out, err)
    assert elapsed < 20, f"ctl wait took {elapsed:.1f}s: it retried a 501"
    assert "weight_version" in err and "Traceback" not in err
