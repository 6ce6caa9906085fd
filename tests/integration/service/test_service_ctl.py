"""``vllm-dp-exporter ctl`` as a subprocess against the in-process server, and ``serve``
as a subprocess whose stderr carries the audit lines (and never the token)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from exporter.base.ports import free_listen_port
from exporter.sim.state import ALL_TAGS
from tests.harness.processes import python_cmd, run_cli
from tests.harness.service import WAIT_S, ServiceFactory

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow

TOKEN = "ctl-token-91b2c3d4e5f6"


def write_token(tmp_path: Path, token: str = TOKEN, name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(token + "\n")
    return str(path)


async def test_ctl_reset_success(fleet_factory: ServiceFactory, tmp_path: Path) -> None:
    tf = write_token(tmp_path)
    fleet = await fleet_factory(2, admin_token_file=tf)
    assert fleet.admin_url is not None
    code, out, err = await run_cli(
        "ctl", "reset-prefix-cache", "--admin-url", fleet.admin_url, "--token-file", tf
    )
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "prefix-cache reset: success"
    assert lines[1].split() == ["ENGINE", "OK", "REASON", "ERROR"]
    assert [line.split()[:2] for line in lines[2:]] == [["0", "yes"], ["1", "yes"]]
    assert TOKEN not in out + err

    code, out, err = await run_cli(
        "ctl",
        "reset-prefix-cache",
        "--admin-url",
        fleet.admin_url,
        "--token-file",
        tf,
        "--reset-running-requests",
        "--json",
    )
    assert code == 0, err
    body = json.loads(out)
    assert body["success"] is True
    assert body["flags"] == {"reset_running_requests": True, "reset_connector": False}
    assert [e.args_of("reset_prefix_cache")[-1] for e in fleet.engines] == [[True], [True]]


async def test_ctl_reset_partial_failure_names_the_engine(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, per_engine={"refuse_reset": {2: True}})
    assert fleet.admin_url is not None
    # One after the other: two resets at once would make one of them a 409.
    code, out, _ = await run_cli("ctl", "reset-prefix-cache", "--admin-url", fleet.admin_url)
    json_code, json_out, _ = await run_cli(
        "ctl", "reset-prefix-cache", "--admin-url", fleet.admin_url, "--json"
    )
    assert code == 2
    assert out.splitlines()[0] == "prefix-cache reset: partial_failure"
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:]}
    assert rows["2"] == ["no", "refused", "-"]
    assert rows["0"][0] == "yes" and rows["1"][0] == "yes"
    assert json_code == 2
    assert json.loads(json_out)["failed_engines"] == [2]


async def test_ctl_reset_errors_exit_1(fleet_factory: ServiceFactory, tmp_path: Path) -> None:
    fleet = await fleet_factory(1, admin_token_file=write_token(tmp_path))
    assert fleet.admin_url is not None
    wrong = write_token(tmp_path, "not-the-token", name="wrong")
    admin = ("ctl", "reset-prefix-cache", "--admin-url", fleet.admin_url)
    # Independent invocations, run side by side to keep the suite fast.
    bad_token, no_token, no_file, unreachable = await asyncio.gather(
        run_cli(*admin, "--token-file", wrong),
        run_cli(*admin),
        run_cli(*admin, "--token-file", str(tmp_path / "missing")),
        # Nothing listens on a port we just freed.
        run_cli(
            "ctl",
            "reset-prefix-cache",
            "--admin-url",
            f"http://127.0.0.1:{free_listen_port()}",
            "--timeout",
            "3",
        ),
    )
    code, out, err = bad_token
    assert code == 1
    assert "401" in err
    assert "not-the-token" not in out + err
    code, _, err = no_token
    assert code == 1 and "401" in err
    code, _, err = no_file
    assert code == 1 and "token file" in err
    code, _, err = unreachable
    assert code == 1 and "ctl:" in err and "Traceback" not in err
    assert [e.calls_by_method.get("reset_prefix_cache", 0) for e in fleet.engines] == [0]


async def test_ctl_status_table_and_json(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3)
    (code, out, err), (down_code, _, down_err) = await asyncio.gather(
        run_cli("ctl", "status", "--url", fleet.url),
        run_cli(
            "ctl", "status", "--url", f"http://127.0.0.1:{free_listen_port()}", "--timeout", "3"
        ),
    )
    assert down_code == 1 and "ctl:" in down_err
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("fleet: awake  engines connected 3/3")
    assert lines[1].split() == [
        "ENGINE", "STATE", "UP", "OUTCOME", "WEIGHTS", "VLLM", "FAULT",
        "HAS_WORK", "RUNNING", "WAITING", "ERROR",
    ]  # fmt: skip
    assert [line.split()[:4] for line in lines[2:]] == [
        [str(i), "awake", "up", "ok"] for i in range(3)
    ]

    fleet.engines[1].state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    (code, out, _), (table_code, table_out, _) = await asyncio.gather(
        run_cli("ctl", "status", "--url", fleet.url, "--json"),
        run_cli("ctl", "status", "--url", fleet.url),
    )
    assert code == 2  # not consistent
    body = json.loads(out)
    assert body["aggregate"]["is_sleeping"]["state"] == "inconsistent"
    assert [e["engine"] for e in body["engines"]] == ["0", "1", "2"]
    assert table_code == 2
    lines = table_out.splitlines()
    assert lines[0].startswith("fleet: inconsistent")
    assert "is_sleeping" in lines[1]  # the aggregate's error names the disagreement
    header = next(i for i, line in enumerate(lines) if line.startswith("ENGINE"))
    assert [line.split()[:3] for line in lines[header + 1 :]] == [
        ["0", "awake", "up"],
        ["1", "asleep", "up"],
        ["2", "awake", "up"],
    ]


async def test_serve_subprocess_audit_lines_on_stderr(tmp_path: Path) -> None:
    """The real ``serve`` and ``sim-engine`` processes: one audit record per admin request in
    the structured log (``--log-format json``: every stderr line one JSON object), and the
    token in none of the output."""
    token_path = write_token(tmp_path)
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    port, admin_port = free_listen_port(), free_listen_port()
    serve = await asyncio.create_subprocess_exec(
        *python_cmd(
            "--log-level",
            "debug",
            "serve",
            "--log-format",
            "json",
            "--engine-count",
            "2",
            "--handshake-address",
            handshake,
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{admin_port}",
            "--admin-token-file",
            token_path,
            "--poll-interval",
            "0.2",
            "--call-timeout",
            "0.5",
            "--reset-min-interval",
            "0",
        ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    engines = await asyncio.create_subprocess_exec(
        *python_cmd(
            "sim-engine",
            "--handshake-address",
            handshake,
            "--engine-count",
            "2",
        ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            deadline = time.monotonic() + 3 * WAIT_S
            while True:
                try:
                    async with http.get(url + "/readyz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "serve never became ready"
                assert serve.returncode is None
                await asyncio.sleep(0.1)
            reset = admin + "/admin/reset_prefix_cache"
            async with http.post(reset, headers={"Authorization": "Bearer nope"}) as resp:
                assert resp.status == 401
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with http.post(reset, params={"reset_connector": "1"}, headers=auth) as resp:
                assert resp.status == 200
        serve.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(serve.communicate(), WAIT_S)
        assert serve.returncode == 0, err.decode()
    finally:
        for proc in (serve, engines):
            if proc.returncode is None:
                proc.kill()
            await asyncio.wait_for(proc.wait(), WAIT_S)
    text = err.decode()
    audits = []
    for line in text.splitlines():
        record = json.loads(line)  # every line, audit or not
        assert {"time", "level", "logger", "message"} <= set(record), record
        if record.get("event") == "admin_request":
            audits.append(record)
    assert [a["status"] for a in audits] == [401, 200]
    denied, ok = audits
    assert denied["outcome"] == "unauthorized" and denied["client"] == "127.0.0.1"
    assert ok["outcome"] == "success" and ok["failed_engines"] == []
    assert ok["flags"] == {"reset_running_requests": False, "reset_connector": True}
    assert ok["logger"] == "exporter.audit" and ok["level"] == "INFO"
    assert time.strptime(ok["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert isinstance(ok["duration_s"], float)
    assert TOKEN not in text and TOKEN not in out.decode()
    assert "DEBUG" in text  # the debug log was on, and still no token
