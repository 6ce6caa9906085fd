"""A process snapshot driven from Python (``exporter.remote``, async and sync) against the real
service over real HTTP, owner mode over simulated vLLM 0.34 engines: prepare, wait until every
rank is ``prepared``, restore, wait until every rank runs; a rank that fails named with its
error while the wait goes on; engines before 0.34 ``Unsupported`` at once."""

from __future__ import annotations

import asyncio

import pytest

from exporter.remote import (
    Client,
    PartialFailure,
    Progress,
    SyncClient,
    Unsupported,
    WaitTimeout,
)
from exporter.sim.options import SimOptions
from tests.harness.service import Service, ServiceFactory

V034 = SimOptions(vllm_version="0.34.0")
ERROR = "CUDA error: device lost"


def client(svc: Service) -> Client:
    return Client(svc.url, svc.admin_url)


def checkpoints(svc: Service) -> list[str]:
    states = [e.state.checkpoint for e in svc.engines]
    return [s.state if s is not None else "none" for s in states]


async def test_a_snapshot_cycle_from_asyncio(fleet: ServiceFactory) -> None:
    svc = await fleet(3, options=V034, gate_min_interval=0.0)
    async with client(svc) as dp:
        prepared = await dp.checkpoint_prepare("abort")
        assert prepared.verified is True and prepared.params == {"mode": "abort"}
        assert [e.engine for e in prepared.engines] == ["0", "1", "2"]
        assert all(e.state[0] in ("preparing", "prepared") for e in prepared.engines)
        assert [e.args_of("checkpoint_prepare")[-1] for e in svc.engines] == [["abort"]] * 3
        opened = await dp.wait(checkpoint="prepared", timeout_s=5, interval_s=0.05)
        assert opened.ok and opened.conditions == {"checkpoint": "prepared"}
        assert checkpoints(svc) == ["prepared"] * 3
        restored = await dp.checkpoint_restore()
        assert restored.verified is True
        assert all(e.state[0] in ("restoring", "running") for e in restored.engines)
        assert (await dp.wait(checkpoint="running", timeout_s=5, interval_s=0.05)).ok
    assert checkpoints(svc) == ["running"] * 3


async def test_a_snapshot_cycle_from_a_plain_thread(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=V034, gate_min_interval=0.0)

    def snapshot() -> list[str]:
        with SyncClient(svc.url, svc.admin_url) as dp:
            done = [dp.checkpoint_prepare(mode="wait").action]
            dp.wait(checkpoint="prepared", timeout_s=5, interval_s=0.05)
            done.append(str(dp.gate(checkpoint="prepared").status))
            done.append(dp.checkpoint_restore().action)
            dp.wait(checkpoint="running", timeout_s=5, interval_s=0.05)
            return done

    assert await asyncio.to_thread(snapshot) == ["checkpoint_prepare", "200", "checkpoint_restore"]
    assert checkpoints(svc) == ["running"] * 2


async def test_a_rank_that_fails_is_named_with_its_error_while_waiting(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(3, options=V034, gate_min_interval=0.0)
    failing = svc.engines[2].state.checkpoint
    assert failing is not None
    failing.fail_with = ERROR
    seen: list[str] = []

    def progress(p: Progress) -> None:
        seen.append(p.summary)

    async with client(svc) as dp:
        with pytest.raises(PartialFailure) as partial:
            await dp.checkpoint_prepare()
        assert [(e.engine, e.reason) for e in partial.value.result.failures] == [
            ("2", "unverified")
        ]
        with pytest.raises(WaitTimeout) as timed_out:
            await dp.wait(checkpoint="prepared", timeout_s=0.3, interval_s=0.05, progress=progress)
    last = timed_out.value.last
    assert last is not None and [e.engine for e in last.failing] == ["2"]
    expected = f"engine 2: checkpoint is 'failed' ({ERROR}), expected 'prepared'"
    assert seen and seen[-1] == expected


async def test_before_0_34_every_form_is_unsupported_at_once(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=SimOptions(vllm_version="0.33.0"), gate_min_interval=0.0)
    async with client(svc) as dp:
        for call in (dp.checkpoint_prepare, dp.checkpoint_restore):
            with pytest.raises(Unsupported) as lacking:
                await call()
            assert lacking.value.status == 501
            assert lacking.value.result is not None and lacking.value.result.unsupported
        with pytest.raises(Unsupported) as unanswerable:
            await dp.wait(checkpoint="prepared", timeout_s=30, interval_s=0.05)
        assert unanswerable.value.conditions == ("checkpoint",)
