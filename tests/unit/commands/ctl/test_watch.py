"""``ctl watch``: one short, greppable, escaped line per rank and per snapshot, heartbeats only
when asked, ``--json`` one object per event, ``--count`` stops after that many rank events,
every reconnect one line on stderr, and the exit codes (0 done, 1 the feed cannot be read)."""

from __future__ import annotations

import argparse
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from exporter.commands.ctl import watch as ctl_watch
from exporter.commands.ctl.common import EXIT_ERROR, EXIT_OK
from exporter.commands.ctl.watch import (
    add_watch_command,
    format_event,
    format_rank,
    format_snapshot,
    report_reconnect,
    run_watch,
)
from exporter.remote import (
    AuthError,
    NotFound,
    Reconnect,
    Reconnecting,
    RemoteError,
    Unreachable,
    WatchEvent,
)

HUNG: dict[str, Any] = {
    "engine": "1",
    "state": "hung",
    "routable": False,
    "reasons": ["hung: no answer for 12 s", "no answer in the last poll (timeout)"],
    "running": 2,
    "waiting": 0,
    "has_work": True,
    "fault_tolerance": "healthy",
}
SNAPSHOT = WatchEvent("snapshot", "ab-3.0", {"reason": "connect", "engines": ["0", "1"]})
RANKS = [
    WatchEvent("rank", "ab-3.1", {"engine": "0", "state": "awake", "routable": True}),
    WatchEvent("rank", "ab-3", HUNG),
]
BEAT = WatchEvent("heartbeat", "ab-3", {"poll": 19, "unix": 1.5})


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ctl")
    add_watch_command(parser.add_subparsers(dest="ctl_command"))
    return parser.parse_args(["watch", *argv])


def test_a_rank_is_one_greppable_line_with_its_activity() -> None:
    assert format_rank(HUNG) == (
        "engine 1: hung (not routable: hung: no answer for 12 s; no answer in the last poll "
        "(timeout)), running 2, waiting 0"
    )
    awake = {"engine": "0", "state": "awake", "routable": True, "reasons": [], "has_work": False}
    assert format_rank(awake) == "engine 0: awake (routable), has_work false"
    faulty = {**awake, "running": None, "has_work": None, "fault_tolerance": "unhealthy"}
    assert format_rank(faulty) == "engine 0: awake (routable), fault_tolerance unhealthy"
    gone = {"engine": "3", "state": "gone", "routable": False, "reasons": ["no longer part"]}
    assert format_rank(gone) == "engine 3: gone (not routable: no longer part)"
    assert format_rank({"engine": "2"}) == "engine 2: unknown (not routable)"


def test_every_string_from_the_feed_is_escaped() -> None:
    hostile = {
        "engine": "0\x1b[2J",
        "state": "awake\r\nengine 9: awake (routable)",
        "routable": False,
        "reasons": ["\u202ebad"],
    }
    line = format_rank(hostile)
    assert "\x1b" not in line and "\n" not in line and "\u202e" not in line
    assert line.startswith("engine 0\\x1b[2J: awake\\r\\nengine 9")
    snapshot = format_snapshot({"reason": "re\x07start", "engines": ["a\x1b", "b"]})
    assert snapshot == "snapshot (re\\x07start): 2 engines: a\\x1b, b"


def test_which_events_are_printed_and_how() -> None:
    shown = [format_event(e, as_json=False, heartbeats=False) for e in [SNAPSHOT, BEAT]]
    assert shown == ["snapshot (connect): 2 engines: 0, 1", None]
    assert format_event(BEAT, as_json=False, heartbeats=True) == "heartbeat (poll 19, id ab-3)"
    assert format_event(BEAT, as_json=True, heartbeats=False) is None
    line = format_event(RANKS[1], as_json=True, heartbeats=False)
    assert line is not None and json.loads(line) == {"event": "rank", "id": "ab-3", **HUNG}
    newer = WatchEvent("membership", "ab-4", {"engines": 3})
    assert format_event(newer, as_json=False, heartbeats=True) is None  # unknown: JSON only
    assert format_event(newer, as_json=True, heartbeats=False) is not None


def test_each_reconnect_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    error = Unreachable("ClientPayloadError: Response payload is not completed")
    report_reconnect(Reconnecting(error, 0, 0.2, "ab-3"))
    report_reconnect(Reconnecting(Unreachable("refused"), 2, 0.4, "ab-3"))
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "ctl: watch: ClientPayloadError: Response payload is not completed; reconnecting in 0.2s",
        "ctl: watch: refused; reconnecting in 0.4s, 2 failed in a row",
    ]


def test_the_defaults() -> None:
    args = parse()
    assert (args.count, args.json, args.heartbeats, args.last_event_id) == (
        None,
        False,
        False,
        None,
    )
    assert args.max_reconnects == Reconnect().max_failures == 30


class FakeWatch:
    """What ``Client.watch`` returns: the events, then an error (or the end)."""

    def __init__(self, events: list[WatchEvent], then: RemoteError | None) -> None:
        self.events = events
        self.then = then
        self.closed = False

    async def __aenter__(self) -> FakeWatch:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.closed = True

    async def _run(self) -> AsyncIterator[WatchEvent]:
        for event in self.events:
            yield event
        if self.then is not None:
            raise self.then

    def __aiter__(self) -> AsyncIterator[WatchEvent]:
        return self._run()


class FakeClient:
    def __init__(self, watch: FakeWatch) -> None:
        self.watch_ = watch
        self.asked: list[Any] = []

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass

    def watch(self, last_event_id: str | None, **kw: Any) -> FakeWatch:
        self.asked.append((last_event_id, kw["reconnect"]))
        return self.watch_


def fake(
    monkeypatch: pytest.MonkeyPatch, events: list[WatchEvent], then: RemoteError | None = None
) -> FakeClient:
    client = FakeClient(FakeWatch(events, then))
    monkeypatch.setattr(ctl_watch, "connect", lambda args, **kw: client)
    return client


async def test_count_stops_after_that_many_rank_events(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = fake(monkeypatch, [SNAPSHOT, BEAT, *RANKS, *RANKS], Unreachable("never reached"))
    args = parse("--count", "2", "--last-event-id", "ab-1", "--max-reconnects", "5")
    assert await run_watch(args) == EXIT_OK
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "snapshot (connect): 2 engines: 0, 1",
        "engine 0: awake (routable)",
        format_rank(HUNG),
    ]
    assert err == "" and client.watch_.closed
    assert client.asked == [("ab-1", Reconnect(max_failures=5))]


async def test_json_prints_every_event_as_one_object(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    fake(monkeypatch, [SNAPSHOT, BEAT, *RANKS])
    assert await run_watch(parse("--json", "--heartbeats")) == EXIT_OK
    out, _ = capsys.readouterr()
    kinds = [json.loads(line)["event"] for line in out.splitlines()]
    assert kinds == ["snapshot", "heartbeat", "rank", "rank"]


@pytest.mark.parametrize(
    ("error", "says"),
    [
        (Unreachable("refused (gave up after 31 failed attempts in a row)"), "ctl: refused (gave"),
        (AuthError("HTTP 401: authentication required", status=401), "ctl: HTTP 401"),
        (NotFound("HTTP 404: Not Found", status=404), "an exporter older than the feed?"),
    ],
)
async def test_a_feed_that_cannot_be_read_exits_1(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    error: RemoteError,
    says: str,
) -> None:
    fake(monkeypatch, [SNAPSHOT], error)
    assert await run_watch(parse()) == EXIT_ERROR
    out, err = capsys.readouterr()
    assert out == "snapshot (connect): 2 engines: 0, 1\n"
    assert err.startswith("ctl: ") and says in err and len(err.splitlines()) == 1


async def test_bad_numbers_fail_before_connecting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(ctl_watch, "connect", None)  # calling it would fail the test
    for argv in (["--count", "-1"], ["--max-reconnects", "-2"]):
        assert await run_watch(parse(*argv)) == EXIT_ERROR
    assert capsys.readouterr().err.count("ctl: --count must be positive") == 2
