"""vLLM 0.34's process-checkpoint lifecycle per rank, owner mode over real ZMQ and real HTTP
(simulated 0.34 engines): ``checkpoint_state`` read per engine with strict consensus (the
fleet's value only when every rank agrees; a rank behind at the first, middle or last
position is an inconsistency with every rank's value, counted), its series and ``/status``;
the gate's ``checkpoint=prepared|running`` (412 naming the ranks behind and their error);
``checkpoint_prepare``/``checkpoint_restore`` verified by reading the state back, a refusal per
rank, 501 on engines before 0.34, never sent to an engine without sleep mode."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory

V034 = SimOptions(vllm_version="0.34.0")
POSITIONS = {"first": 0, "middle": 1, "last": 2}


async def post(svc: Service, path: str, **params: str) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/{path}", params=params) as resp:
        return resp.status, await resp.json()


async def gate(svc: Service, **params: str) -> tuple[int, dict[str, Any]]:
    async with svc.session.get(f"{svc.url}/gate", params=params) as resp:
        return resp.status, await resp.json()


async def checkpoint_verdict(svc: Service) -> dict[str, Any]:
    await svc.fresh_poll()
    verdict: dict[str, Any] = (await svc.status())["aggregate"]["checkpoint_state"]
    return verdict


async def test_prepare_then_restore_drives_every_rank_and_the_gate_follows(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(3, options=V034, gate_min_interval=0.0)
    verdict = await checkpoint_verdict(svc)
    assert verdict["state"] == "consistent" and verdict["value"] == ["running", None]
    assert (await gate(svc, checkpoint="running"))[0] == 200
    code, body = await post(svc, "checkpoint/prepare", mode="abort")  # vLLM's route name
    assert code == 200 and body["outcome"] == "success", body
    assert all(e["state"][0] in ("preparing", "prepared") for e in body["engines"])
    code, ready = await gate(svc, checkpoint="prepared")
    assert code == 200, ready
    await svc.fresh_poll()
    m = await svc.scrape()
    for engine in ("0", "1", "2"):
        assert (
            metric_value(m, "vllm_dp_engine_checkpoint_state", engine=engine, state="prepared")
            == 1.0
        )
        assert (
            metric_value(m, "vllm_dp_engine_checkpoint_state", engine=engine, state="running")
            == 0.0
        )
    code, body = await post(svc, "checkpoint_restore")
    assert code == 200 and body["outcome"] == "success", body
    assert (await gate(svc, checkpoint="running"))[0] == 200
    assert not any(e.state.paused for e in svc.engines)  # serving again


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_behind_is_an_inconsistency_and_the_gate_names_it_with_its_error(
    rl_fleet: ServiceFactory, position: int
) -> None:
    svc = await rl_fleet(3, options=V034, gate_min_interval=0.0)
    behind = svc.engines[position].state.checkpoint
    assert behind is not None
    behind.fail_with = "CUDA error: device lost"
    code, body = await post(svc, "checkpoint_prepare", mode="abort")
    assert code == 502, body  # its drain was over at once: read back failed
    unverified = [(e["engine"], e["reason"]) for e in body["engines"] if e["reason"]]
    assert unverified == [(position, "unverified")]
    verdict = await checkpoint_verdict(svc)
    assert verdict["state"] == "inconsistent"
    expected = [["prepared", None]] * 3
    expected[position] = ["failed", "CUDA error: device lost"]
    assert verdict["values"] == expected
    m = await svc.scrape()  # after the poll checkpoint_verdict waited for
    counted = metric_value(
        m, "vllm_dp_inconsistent_utility_results_total", method="checkpoint_state"
    )
    assert counted is not None and counted >= 1
    code, body = await gate(svc, checkpoint="prepared")
    assert code == 412
    failing = {e["engine"]: e["failures"] for e in body["engines"] if e["failures"]}
    assert failing == {
        str(position): ["checkpoint is 'failed' (CUDA error: device lost), expected 'prepared'"]
    }
    code, body = await post(svc, "checkpoint_restore")  # the failed rank cannot restore
    assert code == 502
    assert [e["engine"] for e in body["engines"] if e["reason"]] == [position]


async def test_a_refusal_is_per_rank_and_nothing_changes_there(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(3, options=V034, gate_min_interval=0.0)
    svc.engines[1].state.sleeping_tags = {"weights"}  # vLLM prepares only an awake engine
    code, body = await post(svc, "checkpoint_prepare", mode="abort")
    assert code == 502 and body["outcome"] == "partial_failure"
    by_engine = {e["engine"]: e for e in body["engines"]}  # the DP rank, as a number
    assert by_engine[1]["reason"] == "refused"
    assert "requires an awake engine" in by_engine[1]["error"]
    assert by_engine[0]["reason"] is None and by_engine[2]["reason"] is None
    checkpoint = svc.engines[1].state.checkpoint
    assert checkpoint is not None and checkpoint.state == "running"


async def test_engines_before_0_34_are_unsupported_and_never_asked_again(
    rl_fleet: ServiceFactory,
) -> None:
    svc = await rl_fleet(2, options=SimOptions(vllm_version="0.33.0"))
    await svc.next_polls(3)
    assert [len(e.args_of("checkpoint_state")) for e in svc.engines] == [1, 1]
    status = await svc.status()
    assert all("checkpoint_state" in e["unsupported"] for e in status["engines"])
    assert status["aggregate"]["checkpoint_state"]["outcome"] == "unsupported"
    code, body = await post(svc, "checkpoint_prepare")
    assert code == 501 and body["outcome"] == "unsupported"
    code, body = await gate(svc, checkpoint="prepared")
    assert code in (412, 501), body


async def test_never_sent_to_an_engine_without_sleep_mode(rl_fleet: ServiceFactory) -> None:
    no_sleep = SimOptions(vllm_version="0.34.0", enable_sleep_mode=False)
    svc = await rl_fleet(2, options=no_sleep)
    code, body = await post(svc, "checkpoint_prepare")
    assert code == 501, body
    assert all("sleep mode" in e["error"] for e in body["engines"])
    assert [len(e.args_of("checkpoint_prepare")) for e in svc.engines] == [0, 0]


@pytest.mark.parametrize("bad", ["mode=later", "mode=wait&mode=abort", "flag=1"])
async def test_bad_requests_are_400_and_reach_no_engine(rl_fleet: ServiceFactory, bad: str) -> None:
    svc = await rl_fleet(2, options=V034)
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/checkpoint_prepare?{bad}") as resp:
        assert resp.status == 400
    code, body = await gate(svc, checkpoint="preparing")
    assert code == 400 and "prepared or running" in body["error"]
    assert [len(e.args_of("checkpoint_prepare")) for e in svc.engines] == [0, 0]
