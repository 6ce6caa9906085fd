"""``vllm-dp-exporter demo`` with an admin token and with a web config, as the docs run it:
the demo's own trainer authenticates with the token; with TLS and basic auth, ``ctl`` and
``exporter.remote`` reach it with the CA and the credentials."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.remote import BasicAuth, Client, Credentials, RemoteError, Secret, Status
from tests.harness.processes import ROOT, clean_env, python_cmd, run_cli, terminate
from tests.harness.tls import PASSWORD, USER, Pki, write_web_config

pytestmark = pytest.mark.slow  # a demo process, and openssl for the certificates

TOKEN = "demo-admin-token-5f6a7b8c9d0e"


def documented_python_loop() -> str:
    """docs/rl.md's RL loop in Python (the first python block after its heading)."""
    text = (ROOT / "docs" / "rl.md").read_text()
    section = text[text.index("### The same loop from Python") :]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, "docs/rl.md has no Python RL loop"
    return found.group(1)


def start_demo(
    tmp_path: Path, *extra: str, attach: str = "http"
) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    port, admin_port = free_listen_port(), free_listen_port()
    log_path = tmp_path / "demo.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            python_cmd(
                "--log-level",
                "warning",
                "demo",
                "--attach",
                attach,  # http: in-process simulated API servers, no engine processes
                "--engines",
                "2",
                "--listen",
                f"127.0.0.1:{port}",
                "--admin-listen",
                f"127.0.0.1:{admin_port}",
                "--reset-every",
                "0.3",
                "--poll-interval",
                "0.2",
                *extra,
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=clean_env(),
        )
    return proc, port, admin_port, log_path


async def until_status(dp: Client, proc: subprocess.Popen[bytes], log: Path) -> Status:
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            status = await dp.status(timeout_s=2)
            if status.engines_connected == 2:
                return status
        except RemoteError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        await asyncio.sleep(0.2)


async def test_the_demo_with_an_admin_token(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    proc, port, admin_port, log = start_demo(tmp_path, "--admin-token-file", str(token_file))
    try:
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        creds = Credentials(Secret(TOKEN))
        async with Client(url, admin, credentials=creds) as dp:
            await until_status(dp, proc, log)
            deadline = time.monotonic() + 30
            while True:  # the demo's own trainer resets with the token
                action = (await dp.status()).raw.get("last_action")
                if action and action["status"] in (200, 502):
                    break
                assert time.monotonic() < deadline, log.read_text()
                await asyncio.sleep(0.2)
        text = log.read_text()
        assert f"Authorization: Bearer $(cat {token_file})" in text
        assert TOKEN not in text
    finally:
        terminate(proc)


async def test_the_documented_python_loop_runs_against_the_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As docs/rl.md says: ``demo --admin-token-file admin-token --story-period 0
    --reset-every 0``, then its Python block, unchanged but for the ports and the token path."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    proc, port, admin_port, log = start_demo(
        tmp_path,
        "--admin-token-file",
        str(token_file),
        "--story-period",
        "0",
        "--reset-every",
        "0",
        attach="owner",
    )
    try:
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        async with Client(url, None) as dp:
            await until_status(dp, proc, log)
        code = documented_python_loop()
        for documented, here in (
            ("http://127.0.0.1:19400", url),
            ("http://127.0.0.1:19401", admin),
            ('token_file="admin-token"', f'token_file="{token_file}"'),
        ):
            assert documented in code
            code = code.replace(documented, here)
        namespace: dict[str, Any] = {}
        await asyncio.wait_for(asyncio.to_thread(exec, code, namespace), 60)
        out = capsys.readouterr().out
        assert "[('0', 'step-1'), ('1', 'step-1')]" in out
        async with Client(url, None) as dp:  # /status is the last poll: it may lag by one
            deadline = time.monotonic() + 10
            while True:
                status = await dp.status()
                if status.consistent and status.engine(0).weight_version == "step-1":
                    break
                assert time.monotonic() < deadline, status.raw
                await asyncio.sleep(0.1)
        assert status.engine(1).state == "awake"
    finally:
        terminate(proc)


async def test_the_demo_behind_tls_and_basic_auth(pki: Pki, tmp_path: Path) -> None:
    web_config = write_web_config(pki.dir / "demo-web.yml", pki, users={USER: PASSWORD})
    proc, port, _, log = start_demo(tmp_path, "--web-config-file", str(web_config))
    try:
        url = f"https://127.0.0.1:{port}"
        creds = Credentials(basic_auth=BasicAuth(USER, Secret(PASSWORD)), ca_file=str(pki.ca_cert))
        async with Client(url, None, credentials=creds) as dp:
            await until_status(dp, proc, log)
        basic = tmp_path / "basic"
        basic.write_text(f"{USER}:{PASSWORD}")
        code, out, err = await run_cli(
            "ctl", "status", "--url", url, "--ca-file", str(pki.ca_cert), "--basic-auth-file",
            str(basic),
        )  # fmt: skip
        assert code in (0, 2), err  # 2: the demo's story makes the fleet inconsistent at times
        assert out.startswith("fleet: ") and "engines connected 2/2" in out
        text = log.read_text()
        assert f"metrics         {url}/metrics" in text
        assert "demo resets     off: the web config serves TLS" in text
    finally:
        terminate(proc)


async def test_a_web_config_that_cannot_be_used_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text("tls_server_config:\n  cert_file: missing.crt\n  key_file: missing.key\n")
    code, _, err = await run_cli("demo", "--attach", "http", "--web-config-file", str(bad))
    assert code == 2 and "Traceback" not in err
    assert err.startswith("vllm-dp-exporter demo: web config file") and "missing.crt" in err
