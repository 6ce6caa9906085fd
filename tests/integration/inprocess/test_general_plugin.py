"""The ``vllm.general_plugins`` entry point: under vLLM's Rust front end (no Python API server,
so the endpoint plugin never runs) it says so once, in vLLM's main process; otherwise, and in
vLLM's child processes, it says and imports nothing (vLLM calls it in every process)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from exporter.inprocess.general_plugin import (
    LOGGER,
    NOTICE,
    rust_front_end_notice,
    rust_front_end_on,
)

#: What vLLM does: find the entry point by group and name, load it, call it (in a fresh process).
CALL_AS_VLLM = """
import sys
from importlib.metadata import entry_points
[plugin] = [p for p in entry_points(group="vllm.general_plugins") if p.name == "dp_exporter"]
plugin.load()()
heavy = sorted(m for m in ("aiohttp", "zmq", "msgspec", "fastapi", "exporter.inprocess.trainer")
               if m in sys.modules)
print("heavy:", heavy)
"""


def run_as_vllm(env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["VLLM_USE_RUST_FRONTEND"] = env_value
    return subprocess.run(
        [sys.executable, "-c", CALL_AS_VLLM],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_under_the_rust_front_end_vllm_s_main_process_logs_one_line() -> None:
    done = run_as_vllm("1")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("VLLM_USE_RUST_FRONTEND=1") == 1, done.stderr
    assert "relay mode" in done.stderr and "HTTP mode" in done.stderr
    assert "heavy: []" in done.stdout  # nothing of the exporter's is imported into vLLM


@pytest.mark.parametrize("value", [None, "0", "", "yes"])
def test_without_the_rust_front_end_nothing_is_said(value: str | None) -> None:
    done = run_as_vllm(value)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "heavy: []" in done.stdout


def test_child_processes_say_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not rust_front_end_notice({"VLLM_USE_RUST_FRONTEND": "1"}, "EngineCore_DP0")
        assert rust_front_end_notice({"VLLM_USE_RUST_FRONTEND": "1"}, "MainProcess")
    assert [r.getMessage() for r in caplog.records] == [NOTICE]


def test_vllm_s_reading_of_the_variable() -> None:
    assert rust_front_end_on({"VLLM_USE_RUST_FRONTEND": "1"})
    assert rust_front_end_on({"VLLM_USE_RUST_FRONTEND": "2"})
    assert not rust_front_end_on({"VLLM_USE_RUST_FRONTEND": "0"})
    assert not rust_front_end_on({"VLLM_USE_RUST_FRONTEND": "true"})  # vLLM's int() refuses it
    assert not rust_front_end_on({})


def test_it_never_raises() -> None:
    class Hostile(dict[str, str]):
        def get(self, *_: object) -> str:
            raise RuntimeError("boom")

    assert rust_front_end_notice(Hostile(), "MainProcess") is False
