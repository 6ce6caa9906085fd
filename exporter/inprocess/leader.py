"""One poller per deployment of several API server processes: the reading file they share.

API server 0 writes each poll's reading to ``vllm_dp_exporter.reading.json`` in
``PROMETHEUS_MULTIPROC_DIR`` (atomically, off vLLM's event loop); the other API servers read it
each poll instead of asking every engine (``exporter.control.sources``). The file is read
bounded, from a regular file only (``read_regular``): a FIFO or a link there is refused, never
waited on. Each write and read runs in a thread of the loop's default executor, which vLLM's
process shares: a poll waits for one at most ``FILE_TIMEOUT_S`` and never queues a second
behind one still running (an ``OSError`` instead: the follower reads the engines itself, the
leader publishes again next poll), so a busy executor or a stuck file system never holds a
poll, and with it every route's verdict, at its last value.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from exporter.inprocess.shared import read_regular

READING_FILE = "vllm_dp_exporter.reading.json"
#: A reading larger than this is not read (256 engines' five reads take about 100 KB).
MAX_READING_BYTES = 4 * 1024 * 1024
#: Seconds a poll waits for the file's write or read in its thread (each takes milliseconds).
FILE_TIMEOUT_S = 2.0

T = TypeVar("T")


class ReadingFile:
    """The deployment's reading in ``directory``: written by the leader, read by the rest."""

    def __init__(self, directory: str | Path, timeout_s: float = FILE_TIMEOUT_S) -> None:
        self.path = Path(directory) / READING_FILE
        self.timeout_s = timeout_s
        self._removed = False
        #: The write and the read still in their threads (at most one of each).
        self._running: dict[str, asyncio.Future[Any]] = {}

    async def publish(self, data: bytes) -> None:
        """The reading written atomically; ``OSError`` when it cannot be (or not in time)."""
        await self._bounded("write", lambda: self._write(data))

    def _write(self, data: bytes) -> None:
        if self._removed:  # a write still in its thread when the leader stopped
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    async def load(self) -> bytes | None:
        """The file's bytes; None when there is none; ``OSError`` when it cannot be read or
        is larger than ``MAX_READING_BYTES`` (or not read in time)."""
        return await self._bounded("read", self._read)

    async def _bounded(self, what: str, work: Callable[[], T]) -> T:
        """``work`` in a thread, waited for at most ``timeout_s``; ``OSError`` at once while
        the last ``what`` is still in its thread (nothing queued behind it)."""
        running = self._running.get(what)
        if running is not None and not running.done():
            raise OSError(f"{self.path}: the last {what} has not returned from its thread")
        future: asyncio.Future[T] = asyncio.ensure_future(asyncio.to_thread(work))
        future.add_done_callback(_retrieved)
        self._running[what] = future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise OSError(f"{self.path}: {what} took over {self.timeout_s:g} s") from None

    def _read(self) -> bytes | None:
        try:
            data = read_regular(str(self.path), MAX_READING_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_READING_BYTES:
            raise OSError(f"{self.path} is larger than {MAX_READING_BYTES} bytes")
        return data

    def remove(self) -> None:
        """The leader's file removed as it stops: the others read the engines at once."""
        self._removed = True
        with contextlib.suppress(OSError):
            self.path.unlink()


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A late thread's failure is retrieved (its poll already went on without it)."""
    if not future.cancelled():
        future.exception()
