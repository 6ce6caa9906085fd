"""``ctl checkpoint prepare|restore``: the flags (a mode only among vLLM's, a step required),
each rank's ``[state, error]`` read back as one escaped cell, and which client call each step
makes (a recorded client, no socket)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from exporter.commands.ctl import add_ctl_arguments
from exporter.commands.ctl import common as ctl_common
from exporter.commands.ctl.checkpoint import checkpoint_cell, format_checkpoint, run_checkpoint
from exporter.commands.ctl.common import EXIT_OK
from exporter.remote import ActionResult


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ctl")
    add_ctl_arguments(parser)
    return parser.parse_args(["checkpoint", *argv])


def test_the_steps_and_their_options(capsys: pytest.CaptureFixture[str]) -> None:
    prepare = parse("prepare", "--mode", "abort", "--admin-url", "http://h:1", "--json")
    assert (prepare.ctl_command, prepare.checkpoint_command) == ("checkpoint", "prepare")
    assert (prepare.mode, prepare.admin_url, prepare.json, prepare.timeout) == (
        "abort",
        "http://h:1",
        True,
        150.0,
    )
    assert parse("prepare").mode is None  # nothing sent: the exporter's default, vLLM's wait
    restore = parse("restore", "--idempotency-key", "snap-1")
    assert (restore.checkpoint_command, restore.idempotency_key) == ("restore", "snap-1")
    for argv in (["prepare", "--mode", "later"], [], ["restore", "--mode", "wait"]):
        with pytest.raises(SystemExit) as refused:
            parse(*argv)
        assert refused.value.code == 2
    assert "invalid choice: 'later'" in capsys.readouterr().err


def test_each_rank_s_state_reads_as_one_escaped_cell() -> None:
    assert checkpoint_cell(["prepared", None]) == "prepared"
    assert checkpoint_cell(["failed", "CUDA\x1b[2J lost"]) == "failed (CUDA\\x1b[2J lost)"
    assert checkpoint_cell(None) == "-"
    body = {
        "action": "checkpoint_prepare",
        "outcome": "partial_failure",
        "engines": [
            {"engine": 0, "ok": True, "reason": None, "state": ["prepared", None]},
            {"engine": 1, "ok": False, "reason": "refused", "state": ["running", None],
             "error": "Preparing for a checkpoint requires an awake engine"},
        ],
    }  # fmt: skip
    lines = format_checkpoint(body).splitlines()
    assert lines[0] == "checkpoint_prepare: partial_failure"
    assert lines[2].split() == ["0", "yes", "-", "prepared", "-"]
    assert lines[3].split()[:4] == ["1", "no", "refused", "running"]
    assert lines[3].endswith("requires an awake engine")


class Recorder:
    """What ``post_admin`` uses of a ``Client``, each call recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def __aenter__(self) -> Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def _answer(self, action: str) -> ActionResult:
        return ActionResult.from_json(action, 200, {"action": action, "engines": []})

    async def checkpoint_prepare(self, mode: Any, **kwargs: Any) -> ActionResult:
        self.calls.append(("prepare", {"mode": mode, **kwargs}))
        return self._answer("checkpoint_prepare")

    async def checkpoint_restore(self, **kwargs: Any) -> ActionResult:
        self.calls.append(("restore", kwargs))
        return self._answer("checkpoint_restore")


async def test_each_step_is_its_client_call(monkeypatch: pytest.MonkeyPatch) -> None:
    made = Recorder()
    monkeypatch.setattr(ctl_common, "connect", lambda args, **where: made)
    assert await run_checkpoint(parse("prepare", "--mode", "keep", "--timeout", "9")) == EXIT_OK
    assert await run_checkpoint(parse("restore", "--idempotency-key", "k")) == EXIT_OK
    assert made.calls == [
        ("prepare", {"mode": "keep", "idempotency_key": None, "timeout_s": 9.0}),
        ("restore", {"idempotency_key": "k", "timeout_s": 150.0}),
    ]
