"""The admin subcommands: each flag becomes the action's parameter (or its body), each answer
one row per engine, and ``verify-weights`` lists what it compared and what differs."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, cast

import pytest

from exporter.commands.ctl import admin
from exporter.commands.ctl.admin import (
    COMMANDS,
    MAX_PARAMETERS_SHOWN,
    add_admin_commands,
    format_action,
    format_reset,
    run_action,
    run_reset,
    runner,
)
from exporter.remote import ActionResult, Client
from exporter.remote.client import RESET_TIMEOUT_S, VERIFY_TIMEOUT_S


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ctl")
    add_admin_commands(parser.add_subparsers(dest="ctl_command"))
    return parser.parse_args(list(argv))


class RecordingClient:
    """The two calls the admin commands make, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def action(self, name: str, params: Any, body: Any, **kwargs: Any) -> ActionResult:
        self.calls.append((name, {"params": params, "body": body, **kwargs}))
        return ActionResult.from_json(name, 200, {})

    async def reset_prefix_cache(self, **kwargs: Any) -> ActionResult:
        self.calls.append(("reset_prefix_cache", kwargs))
        return ActionResult.from_json("reset_prefix_cache", 200, {})


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> RecordingClient:
    """``post_admin`` replaced: the command's call runs against a recording client."""
    recording = RecordingClient()

    async def post_admin(
        args: argparse.Namespace,
        formatter: Callable[[dict[str, Any]], str],
        call: Callable[[Client], Awaitable[ActionResult]],
    ) -> int:
        await call(cast(Client, recording))
        return 0

    monkeypatch.setattr(admin, "post_admin", post_admin)
    return recording


async def test_each_flag_becomes_the_action_s_parameter(client: RecordingClient) -> None:
    for argv in (
        ["sleep", "--level", "2", "--mode", "wait", "--idempotency-key", "k"],
        ["sleep"],
        ["pause", "--mode", "keep"],
        ["pause", "--mode", "keep", "--keep-cache"],
        ["wake-up", "--tags", "weights"],
        ["set-weight-version", "v7", "--timeout", "9"],
        ["verify-weights"],
    ):
        assert await run_action(parse(*argv)) == 0
    assert [(name, c["params"], c["body"]) for name, c in client.calls] == [
        ("sleep", {"level": "2", "mode": "wait"}, None),
        ("sleep", {"level": "1"}, None),  # no mode unless asked: older vLLM takes none
        ("pause", {"mode": "keep"}, None),
        ("pause", {"mode": "keep", "clear_cache": "false"}, None),
        ("wake_up", {"tags": "weights"}, None),
        ("weight_version", {}, {"weight_version": "v7"}),
        ("verify_weights", {}, None),
    ]
    assert client.calls[0][1]["idempotency_key"] == "k"
    assert [c["timeout_s"] for _, c in client.calls[5:]] == [9.0, VERIFY_TIMEOUT_S]


async def test_the_reset_s_flags(client: RecordingClient) -> None:
    await run_reset(parse("reset-prefix-cache", "--reset-connector"))
    assert client.calls == [
        (
            "reset_prefix_cache",
            {
                "reset_running_requests": False,
                "reset_connector": True,
                "idempotency_key": None,
                "timeout_s": RESET_TIMEOUT_S,
            },
        )
    ]


@pytest.mark.parametrize(
    "argv",
    [["sleep", "--level", "3"], ["pause", "--mode", "drop"], ["set-weight-version"]],
)
def test_values_the_server_would_refuse_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2


def test_every_command_has_a_runner_and_no_other_name_does() -> None:
    assert runner("reset-prefix-cache") is run_reset
    assert all(runner(name) is run_action for name in COMMANDS)
    assert runner("status") is None and runner("sleep_") is None
    assert {c.action for c in COMMANDS.values()} >= {"sleep", "wake_up", "weight_version"}


def test_the_reset_table() -> None:
    body = {
        "outcome": "partial_failure",
        "error": "engine 1 refused",
        "engines": [{"engine": 0, "ok": True}, {"engine": 1, "ok": False, "reason": "refused"}],
    }
    assert format_reset(body).splitlines() == [
        "prefix-cache reset: partial_failure (engine 1 refused)",
        "ENGINE  OK   REASON   ERROR",
        "0       yes  -        -",
        "1       no   refused  -",
    ]
    assert format_reset({}).splitlines() == [
        "prefix-cache reset: failure",
        "ENGINE  OK  REASON  ERROR",
    ]


def test_an_action_table_shows_the_state_read_back_escaped() -> None:
    body = {
        "action": "weight_version",
        "outcome": "success",
        "engines": [{"engine": "0", "ok": True, "state": "v7\x1b[2J"}],
    }
    head, header, row = format_action(body).splitlines()
    assert head == "weight_version: success"
    assert header.split() == ["ENGINE", "OK", "REASON", "STATE", "ERROR"]
    assert row.split() == ["0", "yes", "-", "v7\\x1b[2J", "-"]


def test_verify_weights_lists_what_it_compared_and_what_differs() -> None:
    many = [f"layer.{i}" for i in range(MAX_PARAMETERS_SHOWN + 2)]
    body = {
        "action": "verify_weights",
        "outcome": "partial_failure",
        "engines": [
            {
                "engine": 0,
                "ok": True,
                "mismatches": 0,
                "compared": 5,
                "parameters": 5,
                "unverifiable": 0,
            },
            {
                "engine": 1,
                "ok": False,
                "reason": "mismatch",
                "mismatches": 12,
                "compared": 4,
                "parameters": 6,
                "unverifiable": 2,
                "unverifiable_parameters": ["a", "b"],
                "mismatching_parameters": many,
            },
            {"engine": 2, "ok": True, "mismatches": 0},  # an older exporter: no counts
        ],
    }
    lines = format_action(body).splitlines()
    assert lines[1].split()[3] == "MISMATCHES" and lines[3].split()[3] == "12"
    shown = ", ".join(many[:MAX_PARAMETERS_SHOWN])
    assert lines[5:] == [
        "engine 0: compared 5 of 5 parameters",
        "engine 1: compared 4 of 6 parameters; 2 unverifiable (checksum of empty input): a, b",
        f"engine 1 differs on: {shown} (+2 more)",
    ]


def test_a_truncated_list_counts_what_the_server_left_out() -> None:
    engine = {
        "engine": 3,
        "ok": False,
        "compared": 0,
        "parameters": 40,
        "unverifiable": 40,
        "unverifiable_parameters": ["w"],
    }
    notes = format_action({"action": "verify_weights", "engines": [engine]}).splitlines()
    assert notes[-1] == (
        "engine 3: compared 0 of 40 parameters; 40 unverifiable (checksum of empty input): "
        "w (+39 more)"
    )
