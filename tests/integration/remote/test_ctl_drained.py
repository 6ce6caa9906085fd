"""``ctl wait --drained`` and the activity columns of ``ctl status`` over real HTTP, against the
real service with simulated engines (owner mode: ``has_work``; HTTP mode: the running and
waiting counts vLLM publishes too), and against a stand-in for an older exporter.

The commands run in-process (``run_ctl`` in a worker thread, its own event loop, real sockets);
the one case where the process's own exit code matters runs the real command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import pytest
from aiohttp import web

from exporter.commands.ctl import add_ctl_arguments, run_ctl
from exporter.sim.options import SimOptions
from tests.harness.apiservers import ApiServer
from tests.harness.processes import run_cli
from tests.harness.service import Service, ServiceFactory
from tests.integration.remote.conftest import AppServer

FOREVER_S = 600.0


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ctl ARGV`` in this process (a worker thread runs its event loop): (exit, out, err)."""
    parser = argparse.ArgumentParser()
    add_ctl_arguments(parser)
    code = await asyncio.to_thread(run_ctl, parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


def waiting_lines(err: str) -> list[str]:
    """The progress lines of ``ctl wait`` (``ctl: waiting (1.2s): ...``), without the time."""
    return [line.split("): ", 1)[1] for line in err.splitlines() if line.startswith("ctl: waiting")]


async def test_ctl_wait_drained_succeeds_after_the_rank_drains(
    fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await fleet(3, gate_min_interval=0.0)
    svc.engines[2].state.submit(0.8, time.monotonic(), 2)
    started = time.monotonic()
    code, out, err = await ctl(
        capsys, "wait", "--url", svc.url, "--drained", "--timeout", "10", "--interval", "0.1"
    )
    assert code == 0, err
    assert time.monotonic() - started >= 0.5, "it opened before the work was done"
    assert out == "gate open: 3 engines meet drained=true\n"
    # While it waited it said, once, which rank still had work.
    assert waiting_lines(err) == ["engine 2: drained: has work, expected drained=true"]


async def test_ctl_wait_drained_times_out_naming_the_busy_rank_and_its_counts(
    http_fleet: tuple[Service, list[ApiServer]], capsys: pytest.CaptureFixture[str]
) -> None:
    svc, servers = http_fleet
    servers[1].sim.engines[0].submit(FOREVER_S, time.monotonic(), 5)  # 4 run, 1 waits
    started = time.monotonic()
    code, out, err = await ctl(
        capsys,
        "wait",
        "--url",
        svc.url,
        "--drained",
        "--awake",
        "--timeout",
        "0.6",
        "--interval",
        "0.1",
    )
    assert code == 1
    assert 0.6 <= time.monotonic() - started < 10
    busy = "engine 1: drained: has work (running 4, waiting 1), expected drained=true"
    assert out.splitlines() == [busy]
    assert "ctl: wait timed out after 0.6s for sleeping=false drained=true" in err
    assert "(last: HTTP 412)" in err and "Traceback" not in err
    assert waiting_lines(err) == [busy]  # unchanged between checks: reported once

    code, out, _ = await ctl(
        capsys, "wait", "--url", svc.url, "--drained", "--timeout", "0", "--json"
    )
    assert code == 1
    body = json.loads(out)
    assert body["failing_engines"] == ["1"]
    assert body["engines"][1]["requests"] == {"running": 4, "waiting": 1}


async def test_ctl_wait_reports_the_counts_as_they_fall(
    http_fleet: tuple[Service, list[ApiServer]], capsys: pytest.CaptureFixture[str]
) -> None:
    svc, servers = http_fleet
    servers[0].sim.engines[0].submit(0.5, time.monotonic(), 6)  # 4 run, 2 wait; ~1 s in all
    code, _, err = await ctl(
        capsys, "wait", "--url", svc.url, "--drained", "--timeout", "10", "--interval", "0.1"
    )
    assert code == 0, err
    lines = waiting_lines(err)
    assert lines[0] == "engine 0: drained: has work (running 4, waiting 2), expected drained=true"
    assert len(lines) >= 2 and len(set(lines)) == len(lines), lines  # each change, once
    assert all(line.startswith("engine 0: drained: has work (running ") for line in lines)


async def test_ctl_status_shows_what_each_rank_is_doing(
    fleet: ServiceFactory,
    http_fleet: tuple[Service, list[ApiServer]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    owner = await fleet(2)
    owner.engines[1].state.submit(FOREVER_S, time.monotonic(), 1)
    await owner.next_polls()
    code, out, err = await ctl(capsys, "status", "--url", owner.url)
    assert code == 0, err
    _, header, *rows = out.splitlines()
    columns = header.split()
    assert columns == [
        "ENGINE", "STATE", "UP", "OUTCOME", "WEIGHTS", "VLLM", "FAULT",
        "HAS_WORK", "RUNNING", "WAITING", "ERROR",
    ]  # fmt: skip
    at = columns.index("HAS_WORK")
    # Owner mode reads has_work; vLLM publishes no counts to it: "-".
    assert [row.split()[at : at + 3] for row in rows] == [["false", "-", "-"], ["true", "-", "-"]]

    svc, servers = http_fleet
    servers[0].sim.engines[0].submit(FOREVER_S, time.monotonic(), 3)
    await svc.fresh_poll()
    code, out, err = await ctl(capsys, "status", "--url", svc.url)
    assert code == 0, err
    rows = out.splitlines()[2:]
    assert [row.split()[at : at + 3] for row in rows] == [["true", "3", "0"], ["false", "0", "0"]]
    code, out, _ = await ctl(capsys, "status", "--url", svc.url, "--json")
    activity = [e["activity"] for e in json.loads(out)["engines"]]
    assert activity == [
        {"has_work": True, "has_work_read": "asked", "running": 3, "waiting": 0, "drained": False},
        {"has_work": False, "has_work_read": "asked", "running": 0, "waiting": 0, "drained": True},
    ]


async def test_ctl_wait_drained_where_no_vllm_has_has_work_exits_4_at_once(
    fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await fleet(2, options=SimOptions(missing_methods=frozenset({"has_work"})))
    started = time.monotonic()
    code, _, err = await ctl(capsys, "wait", "--url", svc.url, "--drained", "--timeout", "60")
    assert code == 4, err
    assert time.monotonic() - started < 20, "it retried a 501"
    assert err.startswith("ctl: drained=true: ") and "Traceback" not in err


async def test_ctl_wait_drained_against_an_older_exporter_says_so(
    serve_app: AppServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async def gate(request: web.Request) -> web.Response:
        known = "weight_version, sleeping, paused, healthy"
        return web.json_response(
            {"error": f"unknown condition 'drained' (known: {known})"}, status=400
        )

    app = web.Application()
    app.router.add_get("/gate", gate)
    url = await serve_app(app)
    code, out, err = await ctl(capsys, "wait", "--url", url, "--drained", "--timeout", "60")
    assert code == 1 and out == ""
    assert "HTTP 400" in err and "unknown condition 'drained'" in err
    assert err.rstrip().endswith("(this exporter predates the drained condition: upgrade it)")


async def test_ctl_status_refuses_a_malformed_activity(
    serve_app: AppServer, capsys: pytest.CaptureFixture[str]
) -> None:
    row = {"engine": "0", "connected": True, "up": True, "state": "awake"}
    row["activity"] = {"has_work": True, "running": -2, "waiting": 0, "drained": False}

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"engines": [row]})

    app = web.Application()
    app.router.add_get("/status", status)
    url = await serve_app(app)
    code, out, err = await ctl(capsys, "status", "--url", url)
    assert code == 1 and out == ""
    assert "engines[0].activity.running must be a count" in err


@pytest.mark.slow  # the real command, as a subprocess
@pytest.mark.parametrize(
    ("argv", "says", "exit_code"),
    [
        (("--drained", "--busy"), "argument --busy: not allowed with argument --drained", 2),
        (("--drained=true",), "argument --drained: ignored explicit argument 'true'", 2),
        (("--drained", "--timeout", "-1"), "--timeout not negative", 1),
        (("--drained", "--interval", "0"), "--interval must be positive", 1),
    ],
)
async def test_ctl_wait_bad_arguments_are_one_clear_line(
    argv: tuple[str, ...], says: str, exit_code: int
) -> None:
    code, out, err = await run_cli("ctl", "wait", "--url", "http://127.0.0.1:9", *argv)
    assert (code, out) == (exit_code, "")
    assert says in err and "Traceback" not in err
