"""A process snapshot through ``vllm-dp-exporter ctl`` over real HTTP, owner mode over
simulated vLLM 0.34 engines: ``ctl checkpoint prepare`` / ``restore`` (their tables and exit
codes), ``ctl wait --checkpoint``, ``ctl status``'s CHECKPOINT column; a rank that fails named
with its error; engines before 0.34 exit 4 (unsupported) and keep ``ctl status`` as before."""

from __future__ import annotations

import json

import pytest

from exporter.sim.options import SimOptions
from tests.harness.service import Service, ServiceFactory
from tests.integration.rl.test_rl_ctl import admin, ctl, rows

V034 = SimOptions(vllm_version="0.34.0")
ERROR = "CUDA error: device lost"


def waiting(svc: Service, state: str, *extra: str) -> list[str]:
    return ["wait", "--url", svc.url, "--checkpoint", state, "--interval", "0.05", *extra]


def column(out: str) -> dict[str, str]:
    """``ctl status``'s CHECKPOINT cell by engine."""
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("ENGINE"))
    at = header.index("CHECKPOINT")
    body = lines[lines.index(header) + 1 :]
    return {line.split()[0]: line[at:].split("  ")[0].strip() for line in body}


async def test_a_snapshot_through_ctl(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(3, options=V034, gate_min_interval=0.0)
    code, out, err = await ctl(capsys, "checkpoint", "prepare", *admin(svc), "--mode", "abort")
    assert code == 0, err
    assert out.splitlines()[0] == "checkpoint_prepare: success"
    assert {k: v[:2] for k, v in rows(out).items()} == {str(i): ["yes", "-"] for i in range(3)}
    assert all(v[2] in ("preparing", "prepared") for v in rows(out).values())
    assert [e.args_of("checkpoint_prepare")[-1] for e in svc.engines] == [["abort"]] * 3
    code, out, err = await ctl(capsys, *waiting(svc, "prepared", "--timeout", "5"))
    assert code == 0, err
    assert out.strip() == "gate open: 3 engines meet checkpoint=prepared"
    await svc.fresh_poll()
    code, out, _ = await ctl(capsys, "status", "--url", svc.url)
    assert code == 0 and "  checkpoint prepared" in out.splitlines()[0]
    assert column(out) == {str(i): "prepared" for i in range(3)}

    code, out, err = await ctl(capsys, "checkpoint", "restore", *admin(svc), "--json")
    assert code == 0, err
    answer = json.loads(out)
    assert answer["action"] == "checkpoint_restore" and answer["outcome"] == "success"
    code, _, err = await ctl(capsys, *waiting(svc, "running", "--timeout", "5"))
    assert code == 0, err


async def test_a_rank_that_fails_exits_2_and_is_named_with_its_error(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(3, options=V034, gate_min_interval=0.0)
    failing = svc.engines[1].state.checkpoint
    assert failing is not None
    failing.fail_with = ERROR
    code, out, _ = await ctl(capsys, "checkpoint", "prepare", *admin(svc))
    assert code == 2
    assert out.splitlines()[0] == "checkpoint_prepare: partial_failure"
    assert rows(out)["1"][:3] == ["no", "unverified", "failed"]
    assert f"failed ({ERROR})" in out.splitlines()[3]
    code, out, err = await ctl(capsys, *waiting(svc, "prepared", "--timeout", "0.3"))
    assert code == 1
    assert out.strip() == f"engine 1: checkpoint is 'failed' ({ERROR}), expected 'prepared'"
    assert "wait timed out" in err
    await svc.fresh_poll()
    code, out, _ = await ctl(capsys, "status", "--url", svc.url)
    assert "checkpoint INCONSISTENT" in out.splitlines()[0]
    assert column(out) == {"0": "prepared", "1": f"failed ({ERROR})", "2": "prepared"}


async def test_before_0_34_exit_4_and_status_reads_as_before(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(2, options=SimOptions(vllm_version="0.33.0"), gate_min_interval=0.0)
    for step in ("prepare", "restore"):
        code, out, err = await ctl(capsys, "checkpoint", step, *admin(svc))
        assert code == 4, (out, err)
        assert all(v[:2] == ["no", "unsupported"] for v in rows(out).values())
    code, _, err = await ctl(capsys, *waiting(svc, "prepared", "--timeout", "30"))
    assert code == 4 and "checkpoint=prepared" in err
    await svc.fresh_poll()
    code, out, _ = await ctl(capsys, "status", "--url", svc.url)
    assert code == 0 and "CHECKPOINT" not in out and "checkpoint" not in out
