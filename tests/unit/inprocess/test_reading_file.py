"""The deployment's reading file: each write and read bounded in time, none queued behind one
still in its thread (real files in a temporary folder, real threads)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from exporter.inprocess.leader import READING_FILE, ReadingFile

TIMEOUT_S = 0.2


class Held:
    """Wraps a ``ReadingFile`` method: each call blocks its thread until ``release``."""

    def __init__(self, work: Any, fail: bool = False) -> None:
        self._work = work
        self._fail = fail
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        assert self.release.wait(10), "never released"
        if self._fail:
            raise OSError("the disk went away")
        return self._work(*args)


async def settle(file: ReadingFile, what: str) -> None:
    """Until the thread of the last ``what`` returned (bounded)."""
    for _ in range(200):
        running = file._running.get(what)
        if running is None or running.done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the {what} thread never returned")


async def test_a_write_stuck_in_its_thread_is_given_up_and_never_queued_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = ReadingFile(tmp_path, timeout_s=TIMEOUT_S)
    held = Held(file._write)
    monkeypatch.setattr(file, "_write", held)
    started = time.monotonic()
    with pytest.raises(OSError, match=r"took over 0\.2 s"):
        await file.publish(b"first")
    assert time.monotonic() - started < 5  # the poll went on: not the thread's 10 s
    with pytest.raises(OSError, match="last write has not returned"):
        await file.publish(b"second")
    assert held.calls == 1  # the second was never queued behind the first
    held.release.set()
    await settle(file, "write")
    assert (tmp_path / READING_FILE).read_bytes() == b"first"  # the late write landed
    await file.publish(b"third")
    assert (tmp_path / READING_FILE).read_bytes() == b"third" and held.calls == 2


async def test_a_read_stuck_in_its_thread_is_given_up_then_reads_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = ReadingFile(tmp_path, timeout_s=TIMEOUT_S)
    await file.publish(b"reading")
    held = Held(file._read)
    monkeypatch.setattr(file, "_read", held)
    with pytest.raises(OSError, match="read took over"):
        await file.load()
    with pytest.raises(OSError, match="last read has not returned"):
        await file.load()
    assert held.calls == 1
    held.release.set()
    await settle(file, "read")
    assert await file.load() == b"reading"
    # A write is not held by a stuck read (each kind waits only for its own).
    held.release.clear()
    with pytest.raises(OSError):
        await file.load()
    await file.publish(b"newer")
    held.release.set()
    await settle(file, "read")


async def test_a_late_failure_in_its_thread_is_retrieved_not_reported_unhandled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    file = ReadingFile(tmp_path, timeout_s=TIMEOUT_S)
    held = Held(file._write, fail=True)
    monkeypatch.setattr(file, "_write", held)
    unhandled: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unhandled.append(ctx))
    with pytest.raises(OSError, match="took over"):
        await file.publish(b"first")
    held.release.set()
    await settle(file, "write")
    file._running.clear()
    gc.collect()
    await asyncio.sleep(0)
    assert unhandled == []
    monkeypatch.setattr(file, "_write", Held(file._write, fail=True))
    file._write.release.set()  # type: ignore[attr-defined]
    with pytest.raises(OSError, match="the disk went away"):  # in time: its own error
        await file.publish(b"second")
