"""``vllm-dp-exporter probe`` as users run it: real processes and sockets, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from tests.harness.wire import loopback_address

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow

PY = [sys.executable, "-m", "exporter", "--log-level", "error"]


@dataclass
class Group:
    """One sim-engine process: ``count`` engines from ``first`` with extra flags."""

    first: int
    count: int
    flags: tuple[str, ...] = ()


def run_probe(
    groups: list[Group], engine_count: int, *extra: str
) -> tuple[int, dict[str, Any], str]:
    address = loopback_address()
    procs = [
        subprocess.Popen(
            [
                *PY,
                "sim-engine",
                "--handshake-address",
                address,
                "--engine-index",
                str(g.first),
                "--engine-count",
                str(g.count),
                "--handshake-timeout",
                "20",
                *g.flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for g in groups
    ]
    try:
        probe = subprocess.run(
            [
                *PY,
                "probe",
                "--engine-count",
                str(engine_count),
                "--handshake-address",
                address,
                "--ready-timeout",
                "15",
                "--call-timeout",
                "1",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=40,
            stdin=subprocess.DEVNULL,
        )
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
    report = json.loads(probe.stdout) if probe.stdout.strip() else {}
    return probe.returncode, report, probe.stderr


def engines(report: dict[str, Any], key: str = "is_sleeping") -> dict[str, Any]:
    found: dict[str, Any] = report[key]["engines"]
    return found


def test_one_engine_agreeing() -> None:
    code, report, err = run_probe([Group(0, 1)], 1)
    assert code == 0, err
    assert report == {
        "is_sleeping": {
            "value": False,
            "consistent": True,
            "engines": {"0": {"outcome": "ok", "value": False}},
        }
    }
    assert err == ""


def test_two_engines_disagreeing_exit_3() -> None:
    code, report, err = run_probe([Group(0, 1), Group(1, 1, ("--sleeping",))], 2)
    assert code == 3
    assert report["is_sleeping"]["value"] is None and report["is_sleeping"]["consistent"] is False
    assert engines(report)["1"] == {"outcome": "ok", "value": True}
    assert len(err.strip().splitlines()) == 1 and "is_sleeping" in err


def test_eight_engines_all_asleep_and_reset_ok() -> None:
    code, report, err = run_probe([Group(0, 8, ("--sleeping",))], 8, "--reset-prefix-cache")
    assert code == 0, err
    assert report["is_sleeping"]["value"] is True and report["is_sleeping"]["consistent"] is True
    assert report["reset_prefix_cache"] == {
        "success": True,
        "engines": {str(i): {"ok": True} for i in range(8)},
    }


def test_eight_engines_one_refusing_reset_exit_2() -> None:
    groups = [Group(0, 5), Group(5, 1, ("--refuse-reset",)), Group(6, 2)]
    code, report, err = run_probe(groups, 8, "--reset-prefix-cache", "--reset-running-requests")
    assert code == 2
    reset = report["reset_prefix_cache"]
    assert reset["success"] is False
    assert reset["engines"]["5"] == {"ok": False, "reason": "refused"}
    assert all(reset["engines"][str(i)] == {"ok": True} for i in range(8) if i != 5)
    assert "engine 5 refused" in err


def test_hung_engine_exit_1_with_timeout_outcome() -> None:
    code, report, err = run_probe([Group(0, 1), Group(1, 1, ("--hang",))], 2)
    assert code == 1
    assert engines(report)["1"]["outcome"] == "timeout"
    assert engines(report)["0"] == {"outcome": "ok", "value": False}
    assert report["is_sleeping"]["consistent"] is None  # unknown, not inconsistent
    assert "engine 1 timeout" in err


def test_dead_engine_exit_1_with_disconnected_outcome() -> None:
    # The engine answers is_sleeping, then announces its death; the reset sees it dead.
    code, report, _err = run_probe(
        [Group(0, 1), Group(1, 1, ("--dead-after-calls", "1"))], 2, "--reset-prefix-cache"
    )
    assert code == 1
    assert report["reset_prefix_cache"]["engines"]["1"]["reason"] == "disconnected"
    assert report["reset_prefix_cache"]["engines"]["0"] == {"ok": True}


def test_missing_engine_is_a_handshake_error() -> None:
    code, report, _err = run_probe([Group(0, 1)], 2, "--ready-timeout", "1")
    assert code == 1
    assert "did not complete the handshake" in report["error"]
    assert engines(report)["1"]["outcome"] == "disconnected"


@pytest.mark.parametrize(
    ("groups", "expected"),
    [
        # inconsistency and a timeout: 1 wins over 3
        ([Group(0, 1), Group(1, 1, ("--sleeping",)), Group(2, 1, ("--hang",))], 1),
        # inconsistency and a refused reset: 3 wins over 2
        ([Group(0, 1, ("--refuse-reset",)), Group(1, 1, ("--sleeping",))], 3),
    ],
)
def test_exit_code_precedence(groups: list[Group], expected: int) -> None:
    count = sum(g.count for g in groups)
    code, _, err = run_probe(groups, count, "--reset-prefix-cache")
    assert code == expected, err
