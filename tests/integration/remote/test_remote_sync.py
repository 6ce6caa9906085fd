"""``exporter.remote.SyncClient`` from a plain thread (as a training script calls it): the RL
loop with typed results, errors raised in the caller's thread, the progress callback, close."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from exporter.remote import (
    ActionResult,
    Credentials,
    PartialFailure,
    Progress,
    SyncClient,
    WaitTimeout,
)
from exporter.sim.options import SimOptions
from tests.harness.service import ServiceFactory

TOKEN = "sync-token-7d8e9f0a1b2c"


async def test_the_rl_loop_from_a_thread(fleet: ServiceFactory, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    svc = await fleet(
        2,
        options=SimOptions(weight_version="v1"),
        admin_token_file=str(token_file),
        gate_min_interval=0.0,
    )
    creds = Credentials.load(token_file=str(token_file))
    progress_threads: set[str] = set()

    def training_step() -> list[ActionResult]:
        with SyncClient(svc.url, svc.admin_url, credentials=creds) as dp:
            done = [
                dp.pause(mode="wait"),
                dp.sleep(level=1),
                dp.wake_up(["weights"]),
                dp.wake_up(),
                dp.reset_prefix_cache(),
                dp.reset_mm_cache(),
                dp.reset_encoder_cache(),
                dp.weight_version("step-1"),
                dp.verify_weights(),
                dp.resume(),
            ]
            dp.wait(
                {"weight_version": "step-1", "sleeping": False, "paused": False},
                timeout_s=5,
                progress=lambda p: progress_threads.add(threading.current_thread().name),
                interval_s=0.1,
            )
            # /status is the last poll (it may lag the gate's fresh fan-out by one poll).
            deadline = time.monotonic() + 5
            while dp.status().engine(0).weight_version != "step-1":
                assert time.monotonic() < deadline, "the poll never showed step-1"
                time.sleep(0.05)
            return done

    results = await asyncio.to_thread(training_step)
    assert [r.action for r in results] == [
        "pause",
        "sleep",
        "wake_up",
        "wake_up",
        "reset_prefix_cache",
        "reset_mm_cache",
        "reset_encoder_cache",
        "weight_version",
        "verify_weights",
        "resume",
    ]
    assert all(r.success and len(r.engines) == 2 for r in results)
    assert progress_threads <= {"exporter-remote"}  # callbacks run in the client's thread


async def test_errors_reach_the_callers_thread(fleet: ServiceFactory) -> None:
    svc = await fleet(2, per_engine={"refuse_reset": {1: True}}, gate_min_interval=0.0)
    svc.engines[0].state.paused = True
    seen: list[Progress] = []

    def step() -> tuple[PartialFailure, WaitTimeout]:
        with SyncClient(svc.url, svc.admin_url) as dp:
            with pytest.raises(PartialFailure) as partial:
                dp.reset_prefix_cache()
            with pytest.raises(WaitTimeout) as timed_out:
                dp.wait({"paused": False}, 0.3, progress=seen.append, interval_s=0.1)
            return partial.value, timed_out.value

    partial, timed_out = await asyncio.to_thread(step)
    assert partial.result.failed_engines == ("1",)
    assert timed_out.last is not None and timed_out.last.failing_engines == ("0",)
    assert seen and all(p.result is not None and p.result.status == 412 for p in seen)


def test_close_stops_the_thread_and_later_calls_fail() -> None:
    before = {t.ident for t in threading.enumerate()}
    dp = SyncClient("http://127.0.0.1:1", None)
    assert "exporter-remote" in {t.name for t in threading.enumerate()}
    dp.close()
    dp.close()  # idempotent
    assert {t.ident for t in threading.enumerate()} <= before
    with pytest.raises(RuntimeError, match="closed"):
        dp.status()
    assert "127.0.0.1:1" in repr(dp) and "SyncClient" in repr(dp)
