"""docs/rl.md's snapshot recipe as written there, against ``vllm-dp-exporter demo --vllm-version
0.34.0`` (its story off): the ``ctl`` block run by a shell and the Python block run as it is,
but for the ports and the token path; and the demo's HTTP mode showing every simulated API
server's checkpoint state in ``ctl status``'s CHECKPOINT column."""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from exporter.remote import Client
from tests.harness.processes import PYTHON, ROOT, clean_env, run_cli, terminate
from tests.integration.remote.test_remote_demo import TOKEN, start_demo, until_status

pytestmark = pytest.mark.slow  # a demo process and its engine processes

DOCUMENTED = {"admin": "http://127.0.0.1:19401", "url": "http://127.0.0.1:19400"}


def recipe(language: str) -> str:
    """The first ``language`` block of docs/rl.md's process-checkpoint section naming the
    checkpoint calls (the curl block is not it)."""
    text = (ROOT / "docs" / "rl.md").read_text()
    start = text.index("### Process checkpoints (vLLM 0.34)")
    section = text[start : text.index("\n### ", start + 1)]
    for block in re.findall(rf"```{language}\n(.*?)```", section, re.S):
        if "checkpoint" in block and "curl" not in block:
            return str(block)
    raise AssertionError(f"docs/rl.md's snapshot recipe has no {language} block")


def localised(block: str, url: str, admin: str, token_file: Path) -> str:
    for documented, here in (
        (DOCUMENTED["admin"], admin),
        (DOCUMENTED["url"], url),
        ("admin-token", str(token_file)),
    ):
        assert documented in block, documented
        block = block.replace(documented, here)
    return block


async def test_the_documented_snapshot_runs_against_the_demo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(TOKEN + "\n")
    proc, port, admin_port, log = start_demo(
        tmp_path,
        "--admin-token-file", str(token_file), "--story-period", "0", "--reset-every", "0",
        "--vllm-version", "0.34.0",
        attach="owner",
    )  # fmt: skip
    try:
        url, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        async with Client(url, None) as dp:
            status = await until_status(dp, proc, log)
        rows = [e.invariants["checkpoint_state"] for e in status.engines]
        assert [(r.outcome, r.value) for r in rows] == [("ok", ["running", None])] * 2

        shell = localised(recipe("sh"), url, admin, token_file)
        shell = shell.replace("vllm-dp-exporter ", f"{shlex.quote(PYTHON)} -m exporter ")
        done = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-euc", shell],
            cwd=ROOT,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        assert done.stdout.count("gate open: 2 engines meet checkpoint=") == 2, done.stdout
        assert "checkpoint_prepare: success" in done.stdout

        code = localised(recipe("python"), url, admin, token_file)
        namespace: dict[str, Any] = {}
        await asyncio.wait_for(asyncio.to_thread(exec, code, namespace), 60)
        assert "2 ranks prepared" in capsys.readouterr().out
    finally:
        terminate(proc)


async def test_the_http_demo_shows_every_rank_s_checkpoint_state(tmp_path: Path) -> None:
    proc, port, _, log = start_demo(tmp_path, "--vllm-version", "0.34.0", "--story-period", "0")
    try:
        url = f"http://127.0.0.1:{port}"
        async with Client(url, None) as dp:
            await until_status(dp, proc, log)
        code, out, err = await run_cli("ctl", "status", "--url", url)
        assert code == 0, err
        lines = out.splitlines()
        assert "  checkpoint running" in lines[0]
        at = lines[1].index("CHECKPOINT")
        assert {line.split()[0]: line[at:].split()[0] for line in lines[2:]} == {
            "node0": "running",
            "node1": "running",
        }
    finally:
        terminate(proc)
