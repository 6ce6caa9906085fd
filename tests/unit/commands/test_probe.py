"""``probe``'s report and exit code from the engines' outcomes: 0 all answered and agree, 3 they
disagree, 2 a reset was refused, 1 anything else; 1 wins over 3, 3 over 2, and stderr carries
only the lines of the winning code. ``run_probe`` is driven through a fake owner client."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.client.owner import OwnerConfig
from exporter.commands import probe
from exporter.commands.probe import (
    EXIT_ERROR,
    EXIT_INCONSISTENT,
    EXIT_OK,
    EXIT_PARTIAL_RESET,
    ProbeOptions,
    outcome_json,
    probe_report,
    run_probe,
)
from exporter.error import HandshakeError


def ok(engine: str, value: Any) -> EngineOutcome:
    return EngineOutcome(engine, Outcome.OK, value)


ASLEEP = [ok("0", True), ok("1", True)]


def test_each_outcome_as_json() -> None:
    assert outcome_json(ok("0", False)) == {"outcome": "ok", "value": False}
    failed = EngineOutcome("1", Outcome.FAILED, error="no such method")
    assert outcome_json(failed) == {"outcome": "failed", "error": "no such method"}
    split = EngineOutcome("node0", Outcome.INCONSISTENT, values=(True, False))
    assert outcome_json(split) == {"outcome": "inconsistent", "values": [True, False]}


def test_engines_that_agree_exit_zero() -> None:
    report, code, line = probe_report(ASLEEP, None, None)
    assert (code, line) == (EXIT_OK, "")
    assert report == {
        "is_sleeping": {
            "value": True,
            "consistent": True,
            "engines": {
                "0": {"outcome": "ok", "value": True},
                "1": {"outcome": "ok", "value": True},
            },
        }
    }


def test_engines_that_disagree_exit_three() -> None:
    report, code, line = probe_report([ok("0", True), ok("1", False)], None, None)
    assert code == EXIT_INCONSISTENT and "is_sleeping" in line
    assert report["is_sleeping"]["value"] is None and report["is_sleeping"]["consistent"] is False


def test_an_engine_without_an_answer_or_with_a_wrong_one_exits_one() -> None:
    silent = [ok("0", True), EngineOutcome("1", Outcome.TIMEOUT, error="10s")]
    report, code, line = probe_report(silent, None, None)
    assert (code, line) == (EXIT_ERROR, "is_sleeping: engine 1 timeout")
    assert report["is_sleeping"]["consistent"] is None  # unknown, not inconsistent
    report, code, line = probe_report([ok("0", "yes")], None, None)
    assert (code, line) == (EXIT_ERROR, "is_sleeping: engine 0 failed")
    assert report["is_sleeping"]["engines"]["0"]["error"].startswith("expected ")


def test_a_refused_reset_exits_two_and_names_the_engine() -> None:
    reset = [ok("0", True), ok("1", False)]
    report, code, line = probe_report(ASLEEP, reset, None)
    assert (code, line) == (EXIT_PARTIAL_RESET, "reset_prefix_cache: engine 1 refused")
    assert report["reset_prefix_cache"] == {
        "success": False,
        "engines": {"0": {"ok": True}, "1": {"ok": False, "reason": "refused"}},
    }


def test_the_worst_code_wins_and_only_its_lines_are_printed() -> None:
    reset = [ok("0", False), EngineOutcome("1", Outcome.DISCONNECTED, error="gone")]
    report, code, line = probe_report([ok("0", True), ok("1", False)], reset, None)
    assert (code, line) == (EXIT_ERROR, "reset_prefix_cache: engine 1 disconnected")
    assert report["reset_prefix_cache"]["engines"]["1"] == {
        "ok": False,
        "reason": "disconnected",
        "error": "gone",
    }
    report, code, line = probe_report(ASLEEP, [], "2 of 3 engines handshook")
    assert code == EXIT_ERROR and report["error"] == "2 of 3 engines handshook"
    assert line == "2 of 3 engines handshook; reset_prefix_cache: no engine to call"


class FakeTransport:
    def __init__(self, handshake: HandshakeError | None) -> None:
        self.handshake = handshake

    async def wait_connected(self, timeout_s: float) -> None:
        if self.handshake is not None:
            raise self.handshake


class FakeClient:
    """The owner client ``run_probe`` drives: its calls answered from ``answers``."""

    def __init__(self, answers: dict[str, list[EngineOutcome]], handshake: Any = None) -> None:
        self.transport = FakeTransport(handshake)
        self.answers = answers
        self.calls: list[tuple[str, tuple[Any, ...], float]] = []
        self.events: list[str] = []

    async def start(self) -> None:
        self.events.append("start")

    async def close(self) -> None:
        self.events.append("close")

    async def call_utility(
        self, method: str, args: tuple[Any, ...] = (), *, timeout_s: float
    ) -> list[EngineOutcome]:
        self.calls.append((method, args, timeout_s))
        return self.answers[method]


def options(**kwargs: Any) -> ProbeOptions:
    return ProbeOptions(
        OwnerConfig(handshake_address="tcp://127.0.0.1:1", engine_count=2), **kwargs
    )


@pytest.fixture
def fake_owner(monkeypatch: pytest.MonkeyPatch) -> list[FakeClient]:
    """Put the client ``run_probe`` gets in ``fake_owner[0]``."""
    made: list[FakeClient] = []
    monkeypatch.setattr(probe, "OwnerTransport", FakeTransport)
    monkeypatch.setattr(probe, "owner_client", lambda config, faults: made[0])
    return made


async def test_run_probe_prints_the_report_and_closes_the_client(
    fake_owner: list[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient({"is_sleeping": ASLEEP, "reset_prefix_cache": [ok("0", False)]})
    fake_owner.append(client)
    code = await run_probe(
        options(call_timeout_s=4.0, reset_prefix_cache=True, reset_connector=True)
    )
    assert code == EXIT_PARTIAL_RESET and client.events == ["start", "close"]
    assert [(m, t) for m, _, t in client.calls] == [
        ("is_sleeping", 4.0),
        ("reset_prefix_cache", 4.0),
    ]
    out, err = capsys.readouterr()
    assert json.loads(out)["reset_prefix_cache"]["success"] is False
    assert err == "vllm-dp-exporter probe: reset_prefix_cache: engine 0 refused\n"


async def test_a_failed_handshake_is_reported_and_the_engines_still_asked(
    fake_owner: list[FakeClient], capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient({"is_sleeping": ASLEEP}, HandshakeError("1 of 2 engines handshook"))
    fake_owner.append(client)
    assert await run_probe(options()) == EXIT_ERROR
    assert [m for m, _, _ in client.calls] == ["is_sleeping"]  # no reset unless asked
    out, err = capsys.readouterr()
    assert json.loads(out)["error"] == "1 of 2 engines handshook"
    assert err == "vllm-dp-exporter probe: 1 of 2 engines handshook\n"


async def test_the_client_is_closed_when_a_call_fails(fake_owner: list[FakeClient]) -> None:
    client = FakeClient({})  # is_sleeping raises KeyError
    fake_owner.append(client)
    with pytest.raises(KeyError):
        await run_probe(options())
    assert client.events == ["start", "close"]
