"""``vllm-dp-exporter ctl`` for RL loops over real HTTP: one subcommand per admin action and
``ctl wait`` on ``GET /gate``, against a running exporter with simulated engines.

Most cases run the command in-process (``run_ctl`` in a worker thread, its own event loop, real
sockets); the few where the process's exit code itself matters run it as a subprocess.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from exporter.base.ports import free_listen_port
from exporter.commands.ctl import add_ctl_arguments, format_action, run_ctl
from exporter.commands.ctl.wait import format_failing
from exporter.sim.options import SimOptions
from tests.harness.processes import run_cli
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually

CORRUPT = "model.layers.0.mlp.down_proj.weight"
TOKEN = "rl-ctl-token-5e6f7a8b9c"


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ctl ARGV`` in this process (a worker thread runs its event loop): (exit, out, err)."""
    parser = argparse.ArgumentParser()
    add_ctl_arguments(parser)
    code = await asyncio.to_thread(run_ctl, parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def rows(out: str) -> dict[str, list[str]]:
    """Table rows by engine (the line after the header line on)."""
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ENGINE"))
    found = {}
    for line in lines[header + 1 :]:
        if line.startswith("engine "):
            break
        found[line.split()[0]] = line.split()[1:]
    return found


def admin(svc: Service) -> tuple[str, str]:
    assert svc.admin_url is not None
    return "--admin-url", svc.admin_url


async def test_the_rl_loop_through_ctl(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(3, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    a = admin(svc)
    code, out, err = await ctl(capsys, "pause", *a, "--mode", "wait")
    assert code == 0, err
    assert out.splitlines()[0] == "pause: success"
    assert out.splitlines()[1].split() == ["ENGINE", "OK", "REASON", "STATE", "ERROR"]
    assert rows(out) == {str(i): ["yes", "-", "true", "-"] for i in range(3)}
    assert [e.args_of("pause_scheduler")[-1] for e in svc.engines] == [["wait"]] * 3

    code, _, err = await ctl(capsys, "sleep", *a, "--level", "2")
    assert code == 0, err
    assert [e.args_of("sleep")[-1] for e in svc.engines] == [[2]] * 3  # no mode unless asked
    code, out, err = await ctl(
        capsys,
        "wait",
        "--url",
        svc.url,
        "--asleep",
        "--paused",
        "--weight-version",
        "v1",
        "--timeout",
        "5",
    )
    assert code == 0, err
    assert out.strip() == "gate open: 3 engines meet weight_version=v1 sleeping=true paused=true"

    # The trainer's side: weights back on the GPU first, then the new weights, then the cache.
    code, out, err = await ctl(capsys, "wake-up", *a, "--tags", "weights")
    assert code == 0, err
    assert all(e.state.sleeping_tags == {"kv_cache"} for e in svc.engines)
    assert rows(out)["0"] == ["yes", "-", "-", "-"]  # partial wake-up: no state to read back
    code, out, err = await ctl(capsys, "wake-up", *a, "--tags", "kv_cache")
    assert code == 0, err
    for command in ("reset-prefix-cache", "reset-mm-cache", "reset-encoder-cache"):
        code, _, err = await ctl(capsys, command, *a)
        assert code == 0, (command, err)
    assert all(e.args_of("reset_encoder_cache") == [[]] for e in svc.engines)
    code, out, err = await ctl(capsys, "set-weight-version", *a, "step-2")
    assert code == 0, err
    assert rows(out) == {str(i): ["yes", "-", "step-2", "-"] for i in range(3)}
    code, out, err = await ctl(capsys, "verify-weights", *a)
    assert code == 0, err
    assert out.splitlines()[1].split() == ["ENGINE", "OK", "REASON", "MISMATCHES", "ERROR"]
    assert rows(out) == {str(i): ["yes", "-", "0", "-"] for i in range(3)}
    code, _, err = await ctl(capsys, "resume", *a)
    assert code == 0, err
    code, out, err = await ctl(
        capsys,
        "wait",
        "--url",
        svc.url,
        "--weight-version",
        "step-2",
        "--awake",
        "--resumed",
        "--timeout",
        "5",
    )
    assert code == 0, err
    assert out.strip() == (
        "gate open: 3 engines meet weight_version=step-2 sleeping=false paused=false"
    )


async def test_partial_failures_exit_2_and_show_each_engines_state(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(
        3,
        options=SimOptions(weight_version="v1"),
        per_engine={
            "ignore_state_changes": {1: True},
            "corrupt_param": {2: CORRUPT},
            "missing_methods": {0: frozenset({"reset_encoder_cache"})},
        },
    )
    a = admin(svc)
    code, out, _ = await ctl(capsys, "sleep", *a)
    assert code == 2
    assert out.splitlines()[0] == "sleep: partial_failure"
    table = rows(out)
    assert table["0"][:3] == table["2"][:3] == ["yes", "-", "true"]
    assert table["1"][:3] == ["no", "unverified", "false"]  # nothing rolled back: 0 and 2 sleep

    code, out, _ = await ctl(capsys, "verify-weights", *a)
    assert code == 2
    assert rows(out)["2"][:2] == ["no", "mismatch"]
    assert "engine 2 differs on: " in out and CORRUPT in out

    code, out, err = await ctl(capsys, "reset-encoder-cache", *a, "--json")
    assert code == 2, err
    assert '"reason": "unsupported"' in out


async def test_admin_errors_exit_1_and_idempotency_keys_replay(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    svc = await rl_fleet(2, admin_token_file=str(token_file))
    a = (*admin(svc), "--token-file", str(token_file))
    code, _, err = await ctl(capsys, "resume", *admin(svc))
    assert code == 1 and "HTTP 401" in err
    code, _, err = await ctl(capsys, "wake-up", *a, "--tags", "weights,dreams")
    assert code == 1 and "HTTP 400" in err and "tags" in err
    key = ("--idempotency-key", "update-7")
    first = await ctl(capsys, "set-weight-version", *a, *key, "v7")
    again = await ctl(capsys, "set-weight-version", *a, *key, "v7")
    assert first[0] == again[0] == 0 and first[1] == again[1]
    assert [len(e.args_of("set_weight_version")) for e in svc.engines] == [1, 1]
    code, _, err = await ctl(capsys, "set-weight-version", *a, *key, "v8")
    assert code == 1 and "HTTP 422" in err
    code, _, err = await ctl(capsys, "resume", "--admin-url", svc.url)  # the metrics listener
    assert code == 1 and "HTTP 404" in err and "Traceback" not in err
    assert TOKEN not in err


async def test_wait_times_out_naming_what_still_fails(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(3, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    svc.engines[1].state.paused = True
    svc.engines[2].state.weight_version = "v0\x1b[2J"
    started = time.monotonic()
    code, out, err = await ctl(
        capsys,
        "wait",
        "--url",
        svc.url,
        "--weight-version",
        "v1",
        "--awake",
        "--resumed",
        "--timeout",
        "0.6",
        "--interval",
        "0.1",
    )
    assert code == 1
    assert time.monotonic() - started >= 0.6
    assert "timed out after 0.6s for weight_version=v1 sleeping=false paused=false" in err
    assert "(last: HTTP 412)" in err
    lines = out.splitlines()
    assert len(lines) == 2 and all(line.isprintable() for line in lines), lines
    assert lines[0] == (
        "engine 1: sleeping is True, expected False; paused is True, expected False"
    )
    assert lines[1].startswith("engine 2: weight_version is 'v0\\x1b[2J', expected 'v1'")
    assert len(svc.engines[0].args_of("get_weight_version")) > 2, "the gate was polled"


async def test_wait_holds_once_the_fleet_catches_up(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(2, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    waiting = asyncio.create_task(
        ctl(
            capsys,
            "wait",
            "--url",
            svc.url,
            "--weight-version",
            "v2",
            "--timeout",
            "10",
            "--interval",
            "0.1",
        )
    )
    await eventually(lambda: svc.exporter.gate.fanouts >= 2, 5, "two closed gates")
    assert not waiting.done()
    for engine in svc.engines:
        engine.state.weight_version = "v2"
    code, out, err = await asyncio.wait_for(waiting, 5)
    assert code == 0, err
    assert out.startswith("gate open: 2 engines meet weight_version=v2")


async def test_wait_retries_while_the_exporter_is_unreachable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An exporter that is restarting (connection refused) does not fail the wait at once."""
    port = free_listen_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    code, _, err = await ctl(capsys, "wait", "--url", url, "--timeout", "0.5", "--interval", "0.1")
    assert code == 1 and time.monotonic() - started >= 0.5
    assert "last: ClientConnectorError" in err and "Traceback" not in err

    seen: list[dict[str, str]] = []

    async def gate(request: web.Request) -> web.Response:
        seen.append(dict(request.query))
        body: dict[str, Any] = {"ok": True, "conditions": {"paused": False}, "engines": [{}]}
        return web.json_response(body)

    waiting = asyncio.create_task(
        ctl(capsys, "wait", "--url", url, "--resumed", "--timeout", "10", "--interval", "0.1")
    )
    await asyncio.sleep(0.5)  # refused a few times by now
    assert not waiting.done()
    app = web.Application()
    app.router.add_get("/gate", gate)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        code, out, err = await asyncio.wait_for(waiting, 5)
    finally:
        await runner.cleanup()
    assert code == 0, err
    assert seen == [{"paused": "false"}]
    assert out.strip() == "gate open: 1 engines meet paused=false"


async def test_a_question_the_gate_rejects_fails_at_once(
    rl_fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await rl_fleet(1)
    started = time.monotonic()
    code, _, err = await ctl(capsys, "wait", "--url", svc.url, "--weight-version", "x" * 300)
    assert code == 1 and "HTTP 400" in err and "weight_version" in err
    code, _, err = await ctl(capsys, "wait", "--url", admin(svc)[1], "--awake")  # no /gate there
    assert code == 1 and "HTTP 404" in err
    assert time.monotonic() - started < 5, "a rejected question is not retried for 300 s"


def test_formatters_escape_what_engines_and_peers_say() -> None:
    failing = format_failing(
        {
            "error": "no engine\x1b[31m",
            "engines": [
                {"engine": "0", "ok": True, "failures": []},
                {"engine": "1\u202e", "ok": False, "failures": ["paused: timeout (x\ry)"]},
            ],
        }
    )
    assert failing.splitlines() == [
        "no engine\\x1b[31m",
        "engine 1\\u202e: paused: timeout (x\\ry)",
    ]
    action = format_action(
        {
            "action": "verify_weights",
            "outcome": "partial_failure",
            "engines": [
                {
                    "engine": 0,
                    "ok": False,
                    "reason": "mismatch",
                    "mismatches": 12,
                    "mismatching_parameters": [f"p{i}\n" for i in range(12)],
                },
            ],
        }
    )
    assert all(line.isprintable() for line in action.splitlines())
    assert action.splitlines()[-1].endswith("p9\\n (+2 more)")


@pytest.mark.slow
async def test_exit_codes_of_the_real_command(rl_fleet: ServiceFactory) -> None:
    svc = await rl_fleet(
        2,
        options=SimOptions(weight_version="v1"),
        per_engine={"ignore_state_changes": {1: True}},
        gate_min_interval=0.0,
    )
    assert svc.admin_url is not None
    code, out, err = await run_cli("ctl", "sleep", "--admin-url", svc.admin_url)
    assert code == 2, err
    assert [line.split()[:3] for line in out.splitlines()[2:]] == [
        ["0", "yes", "-"],
        ["1", "no", "unverified"],
    ]
    wait = ("ctl", "wait", "--url", svc.url, "--timeout", "0.5", "--interval", "0.1")
    (fails, fails_out, _), (holds, _, holds_err) = await asyncio.gather(
        run_cli(*wait, "--asleep"), run_cli(*wait, "--weight-version", "v1")
    )
    assert fails == 1 and fails_out.startswith("engine 1: sleeping is False, expected True")
    assert holds == 0, holds_err
