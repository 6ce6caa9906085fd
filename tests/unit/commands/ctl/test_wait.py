"""``ctl wait``: the flags become the gate's conditions, and each way the wait ends has its exit
code and its lines: open (0), timed out with what still fails (1), a question the gate rejects
(1, with a hint for an exporter older than ``drained``), a condition no engine answers (4)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from exporter.commands.ctl import wait as ctl_wait
from exporter.commands.ctl.common import EXIT_ERROR, EXIT_OK, EXIT_UNSUPPORTED
from exporter.commands.ctl.wait import (
    Reporter,
    add_wait_command,
    describe_conditions,
    format_failing,
    gate_params,
    rejected,
    run_wait,
)
from exporter.remote import (
    BadRequest,
    GateResult,
    NotFound,
    RemoteError,
    Unsupported,
    WaitTimeout,
)

CLOSED: dict[str, Any] = {
    "conditions": {"weight_version": "v2"},
    "engines": [
        {"engine": "0", "ok": True, "failures": []},
        {"engine": "1", "ok": False, "failures": ["weight_version is 'v1'", "paused is True"]},
    ],
    "failing_engines": ["1"],
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ctl")
    add_wait_command(parser.add_subparsers(dest="ctl_command"))
    return parser.parse_args(["wait", *argv])


def test_no_flag_asks_nothing_and_each_flag_asks_one_condition() -> None:
    assert gate_params(parse()) == {}
    args = parse("--weight-version", "v2", "--awake", "--resumed")
    assert gate_params(args) == {"weight_version": "v2", "sleeping": "false", "paused": "false"}
    assert gate_params(parse("--asleep", "--paused")) == {"sleeping": "true", "paused": "true"}
    defaults = parse()
    assert (defaults.timeout, defaults.interval, defaults.json) == (300.0, 1.0, False)


def test_what_still_fails_one_line_per_engine() -> None:
    assert format_failing(CLOSED).splitlines() == [
        "engine 1: weight_version is 'v1'; paused is True"
    ]
    no_engine = {"error": "no engine\x1b connected", "engines": []}
    assert format_failing(no_engine) == "no engine\\x1b connected"
    names_only = {"engines": [], "failing_engines": ["2", "node1/0"]}
    assert format_failing(names_only) == "failing engines: 2, node1/0"
    assert format_failing({"engines": [{"engine": "3", "ok": False}]}) == "engine 3: failing"


def test_conditions_are_described_escaped() -> None:
    assert describe_conditions({"paused": "false", "weight_version": "v\n2"}) == (
        "paused=false weight_version=v\\n2"
    )
    assert describe_conditions({}) == "(none)"


def test_an_exporter_older_than_drained_is_told_to_upgrade() -> None:
    old = BadRequest("x", status=400, detail="unknown condition 'drained'", url="http://h/gate")
    assert rejected(old, {"drained": "true"}) == (
        "HTTP 400 from http://h/gate: unknown condition 'drained' "
        "(this exporter predates the drained condition: upgrade it)"
    )
    assert "upgrade" not in rejected(old, {"paused": "true"})
    missing = NotFound("x", status=404, detail="no route", url="http://h/gate")
    assert "upgrade" not in rejected(missing, {"drained": "true"})


def test_the_checkpoint_condition_is_one_of_the_states_the_gate_waits_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gate_params(parse("--checkpoint", "prepared")) == {"checkpoint": "prepared"}
    assert gate_params(parse("--checkpoint", "running", "--awake")) == {
        "sleeping": "false",
        "checkpoint": "running",
    }
    with pytest.raises(SystemExit) as refused:
        parse("--checkpoint", "restoring")  # a transition, not a state to wait for
    assert refused.value.code == 2 and "invalid choice: 'restoring'" in capsys.readouterr().err
    old = BadRequest("x", status=400, detail="unknown condition 'checkpoint'", url="http://h/gate")
    assert rejected(old, {"checkpoint": "prepared"}).endswith(
        "(this exporter predates the checkpoint condition: upgrade it)"
    )
    assert "upgrade" not in rejected(old, {"drained": "true"})


@pytest.mark.parametrize("argv", [["--interval", "0"], ["--timeout", "-1"]])
async def test_bad_timings_fail_before_connecting(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ctl_wait, "connect", None)  # calling it would fail the test
    assert await run_wait(parse(*argv)) == EXIT_ERROR
    assert "--interval must be positive" in capsys.readouterr().err


class FakeClient:
    """What ``run_wait`` uses of a ``Client``: the context and one ``wait``."""

    def __init__(self, outcome: GateResult | RemoteError) -> None:
        self.outcome = outcome
        self.asked: list[dict[str, Any]] = []

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def wait(self, conditions: dict[str, str], timeout_s: float, **kw: Any) -> GateResult:
        self.asked.append({"conditions": conditions, "timeout_s": timeout_s, **kw})
        if isinstance(self.outcome, RemoteError):
            raise self.outcome
        return self.outcome


def fake(monkeypatch: pytest.MonkeyPatch, outcome: GateResult | RemoteError) -> FakeClient:
    client = FakeClient(outcome)
    monkeypatch.setattr(ctl_wait, "connect", lambda args, **kw: client)
    return client


async def test_an_open_gate_exits_zero(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened = GateResult.from_json(200, {**CLOSED, "failing_engines": []})
    client = fake(monkeypatch, opened)
    args = parse("--weight-version", "v2", "--timeout", "7", "--interval", "0.5")
    assert await run_wait(args) == EXIT_OK
    assert capsys.readouterr().out == "gate open: 2 engines meet weight_version=v2\n"
    asked = client.asked[0]
    assert (asked["conditions"], asked["timeout_s"], asked["interval_s"]) == (
        {"weight_version": "v2"},
        7.0,
        0.5,
    )
    assert isinstance(asked["progress"], Reporter)
    assert await run_wait(parse("--json")) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == opened.raw


async def test_a_timeout_prints_what_still_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    last = GateResult.from_json(412, CLOSED)
    fake(monkeypatch, WaitTimeout("timed out", last=last, last_error="HTTP 412"))
    assert await run_wait(parse("--weight-version", "v2", "--timeout", "30")) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "engine 1: weight_version is 'v1'; paused is True\n"
    assert err == "ctl: wait timed out after 30s for weight_version=v2 (last: HTTP 412)\n"
    fake(monkeypatch, WaitTimeout("timed out", last=None, last_error="ClientConnectorError: x"))
    assert await run_wait(parse("--json", "--timeout", "1")) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "" and err.endswith("(none) (last: ClientConnectorError: x)\n")


async def test_a_question_the_gate_cannot_answer_or_rejects(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(monkeypatch, Unsupported("HTTP 501: no has_work", status=501, conditions=("drained",)))
    assert await run_wait(parse("--drained")) == EXIT_UNSUPPORTED
    assert capsys.readouterr().err == "ctl: drained=true: HTTP 501: no has_work\n"
    bad = BadRequest("x", status=400, detail="bad weight_version", url="http://h/gate")
    fake(monkeypatch, bad)
    assert await run_wait(parse("--weight-version", "")) == EXIT_ERROR
    assert capsys.readouterr().err == "ctl: HTTP 400 from http://h/gate: bad weight_version\n"
