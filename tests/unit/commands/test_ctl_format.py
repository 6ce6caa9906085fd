"""The ctl tables tell paused apart from asleep (vLLM's is_sleeping is true for both) and show
what each rank is doing; ``ctl wait``'s conditions, its bad arguments and its progress lines."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from exporter.commands.ctl import format_status
from exporter.commands.ctl.wait import Reporter, add_wait_command, gate_params
from exporter.remote import GateResult, Progress, RemoteError, Unreachable
from exporter.remote.status import Status


def _status(sleeping: bool, paused: bool | None) -> dict[str, Any]:
    return {
        "engines_connected": 1,
        "engines_expected": 1,
        "last_poll": {"number": 3},
        "aggregate": {
            "is_sleeping": {"state": "consistent", "value": sleeping},
            "is_scheduler_paused": {
                "state": "consistent" if paused is not None else "unknown",
                "value": paused,
            },
        },
        "engines": [{"engine": "0", "state": "paused" if paused else "asleep", "up": True}],
    }


def test_fleet_verdict_words() -> None:
    assert format_status(_status(True, True)).startswith("fleet: paused ")
    assert format_status(_status(True, False)).startswith("fleet: asleep ")
    assert format_status(_status(True, None)).startswith("fleet: asleep ")
    assert format_status(_status(False, False)).startswith("fleet: awake ")


def test_the_table_names_faulty_ranks() -> None:
    body = _status(False, False)
    body["fault_tolerance"] = {"healthy": False, "faulty_engines": ["0"], "reported_engines": ["0"]}
    body["engines"][0]["fault_tolerance"] = {"status": "unhealthy", "fault_info": "RuntimeError"}
    head, header, row = format_status(body).splitlines()
    assert head.endswith("FAULTY 0") and "FAULT" in header.split()
    assert "unhealthy (RuntimeError)" in row
    assert "FAULTY" not in format_status(_status(False, False))
    assert format_status(_status(False, False)).splitlines()[2].split()[6] == "-"


def test_a_mode_that_cannot_know_says_so_and_never_healthy() -> None:
    """E4: relay mode's null verdict reads as not available, in ctl and in exporter.remote."""
    body = _status(False, False)
    body["fault_tolerance"] = {
        "healthy": None,
        "faulty_engines": [],
        "reported_engines": [],
        "note": "not available in this attach mode",
    }
    head = format_status(body).splitlines()[0]
    assert head.endswith("fault tolerance: not available in this mode")
    assert Status.from_json(body).healthy is None


def test_wait_healthy_asks_the_gate_for_healthy_ranks() -> None:
    parser = argparse.ArgumentParser()
    add_wait_command(parser.add_subparsers())
    assert gate_params(parser.parse_args(["wait", "--healthy"])) == {"healthy": "true"}
    assert "healthy" not in gate_params(parser.parse_args(["wait", "--awake"]))


def _wait_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctl")
    add_wait_command(parser.add_subparsers())
    return parser


def test_the_table_shows_each_engine_s_activity() -> None:
    body = _status(False, False)
    body["engines"] = [
        {**body["engines"][0], "engine": "0", "activity": _activity(True, 3, 1)},
        {**body["engines"][0], "engine": "1", "activity": _activity(False, 0, 0)},
        {**body["engines"][0], "engine": "2", "activity": _activity(None, None, None)},
        {**body["engines"][0], "engine": "3", "activity": _activity(False, None, None)},
        {**body["engines"][0], "engine": "4"},  # an exporter older than the field
    ]
    _, header, *rows = format_status(body).splitlines()
    columns = header.split()
    assert columns[-4:] == ["HAS_WORK", "RUNNING", "WAITING", "ERROR"]
    at = columns.index("HAS_WORK")
    assert [row.split()[at : at + 3] for row in rows] == [
        ["true", "3", "1"],
        ["false", "0", "0"],
        ["-", "-", "-"],
        ["false", "-", "-"],
        ["-", "-", "-"],
    ]


def _activity(has_work: bool | None, running: int | None, waiting: int | None) -> dict[str, Any]:
    drained = None if has_work is None else (not has_work and not running and not waiting)
    return {"has_work": has_work, "running": running, "waiting": waiting, "drained": drained}


def test_wait_drained_and_busy_ask_the_gate() -> None:
    parser = _wait_parser()
    assert gate_params(parser.parse_args(["wait", "--drained"])) == {"drained": "true"}
    assert gate_params(parser.parse_args(["wait", "--busy"])) == {"drained": "false"}
    both = parser.parse_args(["wait", "--drained", "--paused", "--weight-version", "v2"])
    assert gate_params(both) == {"weight_version": "v2", "paused": "true", "drained": "true"}
    assert "drained" not in gate_params(parser.parse_args(["wait", "--awake"]))


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["wait", "--drained", "--busy"], "argument --busy: not allowed with argument --drained"),
        (["wait", "--drained=yes"], "argument --drained: ignored explicit argument 'yes'"),
        (["wait", "--drained", "--timeout", "soon"], "argument --timeout: invalid float value"),
    ],
)
def test_wait_rejects_bad_arguments_with_a_clear_error(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        _wait_parser().parse_args(argv)
    assert exited.value.code == 2
    assert says in capsys.readouterr().err


def _progress(
    attempt: int, body: dict[str, Any] | None, error: RemoteError | None = None
) -> Progress:
    result = GateResult.from_json(412, body) if body is not None else None
    return Progress(attempt, attempt * 0.5, 10.0 - attempt, result, error)


def _busy(running: int) -> dict[str, Any]:
    failure = f"drained: has work (running {running}, waiting 0), expected drained=true"
    return {
        "conditions": {"drained": True},
        "engines": [
            {"engine": "0", "ok": True, "failures": [], "requests": None},
            {
                "engine": "1\x1b[2J",
                "ok": False,
                "failures": [failure],
                "requests": {"running": running, "waiting": 0},
            },
        ],
        "failing_engines": ["1\x1b[2J"],
    }


def test_wait_reports_busy_ranks_on_stderr_each_time_they_change(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = Reporter()
    report(_progress(1, _busy(2)))
    report(_progress(2, _busy(2)))  # unchanged: nothing printed
    report(_progress(3, _busy(1)))
    report(_progress(4, None, Unreachable("ClientConnectorError: refused")))
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "ctl: waiting (0.5s): engine 1\\x1b[2J: drained: has work (running 2, waiting 0), "
        "expected drained=true",
        "ctl: waiting (1.5s): engine 1\\x1b[2J: drained: has work (running 1, waiting 0), "
        "expected drained=true",
        "ctl: waiting (2.0s): ClientConnectorError: refused",
    ]
