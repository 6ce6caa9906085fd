"""``ctl status``: the fleet's line and one row per engine from ``/status``, exit 0 only for a
consistent fleet, and one line on stderr saying why the status could not be read."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from exporter.commands.ctl import status as ctl_status
from exporter.commands.ctl.common import EXIT_ERROR, EXIT_OK, EXIT_PARTIAL
from exporter.commands.ctl.status import (
    CHECKPOINT_HEADER,
    HEADERS,
    add_status_command,
    format_status,
    run_status,
)
from exporter.remote import AuthError, InvalidAnswer, RemoteError, Status, Unreachable

DOC: dict[str, Any] = {
    "engines_connected": 2,
    "engines_expected": 3,
    "last_poll": {"number": 41},
    "aggregate": {
        "is_sleeping": {"state": "consistent", "value": False},
        "get_weight_version": {"state": "consistent", "value": "v\x1b7"},
    },
    "engines": [
        {
            "engine": "0",
            "state": "awake",
            "up": True,
            "vllm_version": "0.33.0",
            "invariants": {
                "is_sleeping": {"value": False, "outcome": "ok"},
                "get_weight_version": {"value": "v7", "outcome": "ok"},
            },
        },
        {
            "engine": "1",
            "state": "unknown",
            "up": False,
            "invariants": {
                "is_sleeping": {"outcome": "timeout", "error": "no answer"},
                "get_weight_version": {"value": "v6", "outcome": "ok"},
            },
        },
    ],
}


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ctl")
    add_status_command(parser.add_subparsers(dest="ctl_command"))
    return parser.parse_args(["status", *argv])


def test_the_fleet_line_names_counts_poll_and_weights() -> None:
    head, header, up, down = format_status(DOC).splitlines()
    assert head == "fleet: awake  engines connected 2/3  last poll #41  weights v\\x1b7"
    assert header.split() == HEADERS
    assert up.split()[:6] == ["0", "awake", "up", "ok", "v7", "0.33.0"]
    cells = down.split()
    assert cells[:5] == ["1", "unknown", "down", "timeout", "-"]  # no weights while down
    assert " ".join(cells[-2:]) == "no answer"


def test_split_weights_and_verdict_errors_are_shown() -> None:
    body = {
        **DOC,
        "aggregate": {
            "is_sleeping": {"state": "inconsistent", "error": "engines disagree:\x1b[2J 0, 1"},
            "get_weight_version": {"state": "inconsistent", "error": "v6 != v7"},
        },
    }
    lines = format_status(body).splitlines()
    assert (
        lines[0]
        == "fleet: inconsistent  engines connected 2/3  last poll #41  weights INCONSISTENT"
    )
    assert lines[1:3] == ["engines disagree:\\x1b[2J 0, 1", "v6 != v7"]
    assert "weights" not in format_status({**DOC, "aggregate": {}}).splitlines()[0]


def with_checkpoints(*rows: dict[str, Any], verdict: dict[str, Any]) -> dict[str, Any]:
    engines = [
        {**e, "invariants": {**e["invariants"], "checkpoint_state": row}}
        for e, row in zip(DOC["engines"], rows, strict=True)
    ]
    return {
        **DOC,
        "engines": engines,
        "aggregate": {**DOC["aggregate"], "checkpoint_state": verdict},
    }


def test_a_checkpoint_column_only_when_an_engine_reports_one() -> None:
    assert CHECKPOINT_HEADER not in format_status(DOC)  # an exporter or vLLM without it
    unsupported = {"outcome": "unsupported", "value": None}
    before = with_checkpoints(unsupported, unsupported, verdict={"state": "unknown"})
    assert format_status(before) == format_status(DOC)  # vLLM before 0.34 reads as before
    failed = {"outcome": "ok", "value": ["failed", "CUDA error:\x1b[2J lost"]}
    body = with_checkpoints(
        {"outcome": "ok", "value": ["prepared", None]},
        failed,
        verdict={"state": "inconsistent", "values": [["prepared", None], failed["value"]]},
    )
    head, header, up, down = format_status(body).splitlines()
    assert head.endswith("weights v\\x1b7  checkpoint INCONSISTENT")
    names = header.split()
    assert names[names.index("FAULT") + 1 : names.index("FAULT") + 3] == ["CHECKPOINT", "HAS_WORK"]
    at = header.index("CHECKPOINT")
    assert up[at:].split()[0] == "prepared"
    assert down[at:].startswith("failed (CUDA error:\\x1b[2J lost)")
    agreed = with_checkpoints(
        {"outcome": "ok", "value": ["prepared", None]},
        {"outcome": "failed", "value": None, "error": "response is not JSON"},  # unknown: -
        verdict={"state": "consistent", "value": ["prepared", None]},
    )
    head, header, _, down = format_status(agreed).splitlines()
    assert head.endswith("  checkpoint prepared")
    assert down[header.index("CHECKPOINT") :].split()[0] == "-"


def test_the_options_and_their_defaults() -> None:
    args = parse()
    assert (args.url, args.json, args.timeout) == ("http://127.0.0.1:19400", False, 10.0)
    assert parse("--url", "http://h:8000/dp", "--json").url == "http://h:8000/dp"


class FakeClient:
    """What ``run_status`` uses of a ``Client``: the context and one ``status``."""

    def __init__(self, answer: dict[str, Any] | RemoteError) -> None:
        self.answer = answer
        self.timeouts: list[float] = []

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def status(self, *, timeout_s: float) -> Status:
        self.timeouts.append(timeout_s)
        if isinstance(self.answer, RemoteError):
            raise self.answer
        return Status.from_json(self.answer)


@pytest.fixture
def answer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any] | RemoteError]:
    """Set ``answer[0]`` to what ``/status`` answers."""
    box: list[dict[str, Any] | RemoteError] = [DOC]

    def connect(args: argparse.Namespace, *, url: str | None, admin_url: str | None) -> Any:
        assert url == args.url and admin_url is None  # a read needs no admin listener
        return FakeClient(box[0])

    monkeypatch.setattr(ctl_status, "connect", connect)
    return box


async def test_exit_zero_only_for_a_consistent_fleet(
    answer: list[dict[str, Any] | RemoteError], capsys: pytest.CaptureFixture[str]
) -> None:
    assert await run_status(parse()) == EXIT_OK
    assert capsys.readouterr().out.startswith("fleet: awake")
    answer[0] = {**DOC, "aggregate": {"is_sleeping": {"state": "unknown"}}}
    assert await run_status(parse("--json")) == EXIT_PARTIAL
    assert json.loads(capsys.readouterr().out) == answer[0]


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (Unreachable("ClientConnectorError: refused"), "ctl: ClientConnectorError: refused"),
        (
            AuthError("HTTP 401: no", status=401, url="http://h/status"),
            "ctl: HTTP 401 from http://h/status",
        ),
        (AuthError("HTTP 403: no", status=403), "ctl: HTTP 403 from http://127.0.0.1:19400"),
        (
            InvalidAnswer(
                "x", status=200, detail="the answer is not JSON: <html>", url="http://h/status"
            ),
            "ctl: http://h/status: the answer is not JSON: <html>",
        ),
        (
            InvalidAnswer("HTTP 500: not JSON", status=500),
            "ctl: HTTP 500 from http://127.0.0.1:19400",
        ),
    ],
)
async def test_why_the_status_could_not_be_read(
    answer: list[dict[str, Any] | RemoteError],
    capsys: pytest.CaptureFixture[str],
    error: RemoteError,
    line: str,
) -> None:
    answer[0] = error
    assert await run_status(parse()) == EXIT_ERROR
    assert capsys.readouterr() == ("", line + "\n")
