"""``ctl watch`` over real HTTP against the real service with simulated engines: ``--count``
and ``--json`` (in-process: ``run_ctl`` in a worker thread, real sockets), the ways it fails
(exit 1, one line), and as the real command: a frozen rank printed hung, a dropped connection
resumed without a second snapshot, SIGTERM and SIGINT a clean exit 0, and a reader that leaves
the pipe no traceback."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from exporter.base.ports import free_listen_port
from exporter.commands.ctl import add_ctl_arguments, run_ctl
from exporter.feed.hub import WatchHub
from tests.harness.processes import ROOT, clean_env, python_cmd
from tests.harness.service import ServiceFactory
from tests.harness.waiting import eventually
from tests.integration.remote.conftest import AppServer

LINE_WAIT_S = 15.0  # a subprocess's first line includes the interpreter's start
HUNG_AFTER_S = 0.8


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``ctl ARGV`` in this process (a worker thread runs its event loop): (exit, out, err)."""
    parser = argparse.ArgumentParser()
    add_ctl_arguments(parser)
    code = await asyncio.wait_for(
        asyncio.to_thread(run_ctl, parser.parse_args(list(argv))), LINE_WAIT_S
    )
    out, err = capsys.readouterr()
    return code, out, err


async def test_count_stops_after_that_many_rank_events(
    fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await fleet(3)
    code, out, err = await ctl(capsys, "watch", "--url", svc.url, "--count", "3")
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "snapshot (connect): 3 engines: 0, 1, 2",
        "engine 0: awake (routable), has_work false",
        "engine 1: awake (routable), has_work false",
        "engine 2: awake (routable), has_work false",
    ]
    assert svc.exporter.feed.counts.refused == 0


async def test_json_is_one_event_object_per_line(
    fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await fleet(2)
    code, out, _ = await ctl(capsys, "watch", "--url", svc.url, "--json", "--count", "2")
    assert code == 0
    head, *rows = [json.loads(line) for line in out.splitlines()]
    assert head["event"] == "snapshot" and head["reason"] == "connect"
    assert head["epoch"] == svc.exporter.feed.epoch and head["engines"] == ["0", "1"]
    assert [(r["event"], r["engine"], r["routable"]) for r in rows] == [
        ("rank", "0", True),
        ("rank", "1", True),
    ]
    assert re.fullmatch(r"[0-9a-f]+-\d+\.0", head["id"]) and rows[-1]["id"] == head["id"][:-2]
    assert {"state", "reasons", "running", "waiting", "hung", "poll"} <= set(rows[0])


async def test_it_resumes_from_an_id_given(
    fleet: ServiceFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    _, out, _ = await ctl(capsys, "watch", "--url", svc.url, "--json", "--count", "2")
    last = json.loads(out.splitlines()[-1])["id"]
    svc.engines[1].state.paused = True
    await eventually(
        lambda: svc.exporter.poller.snapshot.engines[1].state == "paused", what="rank 1 paused"
    )
    code, out, err = await ctl(
        capsys, "watch", "--url", svc.url, "--last-event-id", last, "--count", "1"
    )
    assert (code, err) == (0, "")
    assert out == "engine 1: paused (not routable: paused), has_work false\n"  # no snapshot


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--count", "0"), "--count must be positive"),
        (("--max-reconnects", "-1"), "--max-reconnects not negative"),
        (("--last-event-id", "a\tb"), "last_event_id must be 1-256 printable ASCII"),
    ],
)
async def test_bad_arguments_are_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], says: str
) -> None:
    code, out, err = await ctl(capsys, "watch", "--url", "http://127.0.0.1:9", *argv)
    assert (code, out) == (1, "") and says in err and len(err.splitlines()) == 1


async def test_an_exporter_that_cannot_be_reached_ends_in_exit_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"http://127.0.0.1:{free_listen_port()}"  # nothing listens there
    started = time.monotonic()
    code, out, err = await ctl(capsys, "watch", "--url", url, "--max-reconnects", "2")
    assert (code, out) == (1, "") and time.monotonic() - started < LINE_WAIT_S
    lines = err.splitlines()
    assert len(lines) == 3 and "Traceback" not in err
    assert lines[0].startswith("ctl: watch: ") and "reconnecting in 0.2s, 1 failed" in lines[0]
    assert "reconnecting in 0.4s, 2 failed in a row" in lines[1]
    assert lines[2].startswith("ctl: ") and "gave up after 3 failed attempts in a row" in lines[2]


async def test_no_feed_or_no_credentials_exit_1_at_once(
    serve_app: AppServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async def unauthorized(request: web.Request) -> web.Response:
        return web.json_response({"error": "authentication required"}, status=401)

    app = web.Application()
    app.router.add_get("/dp/watch", unauthorized)
    url = await serve_app(app)
    code, out, err = await ctl(capsys, "watch", "--url", url + "/dp")
    assert (code, out) == (1, "") and "HTTP 401" in err and "reconnecting" not in err
    code, out, err = await ctl(capsys, "watch", "--url", url)
    assert (code, out) == (1, "") and "HTTP 404" in err
    assert "no /watch there: an exporter older than the feed?" in err


@asynccontextmanager
async def watch_process(
    *argv: str, stdout: int = asyncio.subprocess.PIPE
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``python -m exporter ctl watch ARGV``, killed at the end if still running."""
    proc = await asyncio.create_subprocess_exec(
        *python_cmd("ctl", "watch", *argv),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=stdout,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=clean_env(),
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def line_where(
    proc: asyncio.subprocess.Process, predicate: Callable[[str], bool]
) -> list[str]:
    """Every stdout line up to the first for which ``predicate`` holds (bounded)."""
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + LINE_WAIT_S
    while not seen or not predicate(seen[-1]):
        raw = await asyncio.wait_for(proc.stdout.readline(), deadline - time.monotonic())
        assert raw, f"the command ended; it printed {seen}"
        seen.append(raw.decode().rstrip("\n"))
    return seen


async def ended(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    assert proc.stderr is not None
    err = await asyncio.wait_for(proc.stderr.read(), LINE_WAIT_S)
    return await asyncio.wait_for(proc.wait(), LINE_WAIT_S), err.decode()


def drop_all(hub: WatchHub) -> None:
    for watcher in list(hub.watchers):
        hub.drop(watcher)


@pytest.mark.slow  # the real command, as a subprocess
async def test_the_command_prints_a_hung_rank_and_sigterm_ends_it_with_0(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(2, hung_after=HUNG_AFTER_S, gate_min_interval=0.0)
    async with watch_process("--url", svc.url) as proc:
        await line_where(proc, lambda line: line.startswith("engine 1: "))
        svc.engines[1].options.frozen = True
        lines = await line_where(proc, lambda line: line.startswith("engine 1: hung "))
        assert re.fullmatch(r"engine 1: hung \(not routable: hung: no answer for .+\)", lines[-1])
        proc.send_signal(signal.SIGTERM)
        code, err = await ended(proc)
    assert (code, err) == (0, "")


@pytest.mark.slow  # the real command, as a subprocess
async def test_the_command_resumes_after_a_drop_and_sigint_ends_it_with_0(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    hub = svc.exporter.feed
    async with watch_process("--url", svc.url) as proc:
        first = await line_where(proc, lambda line: line.startswith("engine 1: "))
        assert first[0] == "snapshot (connect): 2 engines: 0, 1"
        drop_all(hub)
        await eventually(
            lambda: [w.start for w in hub.watchers] == ["resume"], LINE_WAIT_S, "the resume"
        )
        svc.engines[0].state.paused = True
        after = await line_where(proc, lambda line: line.startswith("engine 0: paused "))
        assert not any(line.startswith("snapshot") for line in after), after
        proc.send_signal(signal.SIGINT)
        code, err = await ended(proc)
    assert code == 0 and "Traceback" not in err
    [notice] = err.splitlines()
    assert notice.startswith("ctl: watch: ") and notice.endswith("reconnecting in 0.2s")


@pytest.mark.slow  # the real command, as a subprocess
async def test_a_reader_that_leaves_the_pipe_ends_it_quietly(fleet: ServiceFactory) -> None:
    """``ctl watch | head -1``: exit 0 once the reader is gone, no traceback."""
    svc = await fleet(2, gate_min_interval=0.0)
    read_fd, write_fd = os.pipe()
    async with watch_process("--url", svc.url, stdout=write_fd) as proc:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as out:
            first = await asyncio.wait_for(asyncio.to_thread(out.readline), LINE_WAIT_S)
        assert first.startswith(b"snapshot (connect)")  # and the reader leaves
        svc.engines[0].state.paused = True  # a change: the command writes to no reader
        code, err = await ended(proc)
    assert (code, err) == (0, "")
