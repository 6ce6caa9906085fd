"""Each API server process's families in a file; any process answers ``/metrics`` for all.

With several API servers (``--api-server-count``, vLLM's default under DP with internal load
balancing), vLLM sets ``PROMETHEUS_MULTIPROC_DIR`` to a directory every API server shares, and a
scrape reaches one of them at random. Each process writes its families to
``<dir>/vllm_dp_exporter.<index>.json`` (atomically, when its state changed) and the process
that answers merges them (``exporter.metrics.merge``): gauges from API server 0, counters and
histograms summed over every process, each read from its file (its own included: up to a
second old, the same whichever process answers). A file that cannot be read or believed is
skipped with one warning per file and minute; a file older than ``stale_s`` (a process that is
gone) is skipped. Only the files of API servers ``0 .. count-1`` are this deployment's: a file
of another index (a previous run with more API servers, a stray copy) is skipped with a warning,
never summed (its counters would jump in, then drop out a minute later: a counter reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Hashable
from pathlib import Path

from exporter.metrics.families import Family
from exporter.metrics.merge import BadShare, families_from_json, families_to_json, merge_processes

log = logging.getLogger("exporter.inprocess")

#: Only the name a process writes (no leading zero: ``01`` would stand in for API server 1).
FILE = re.compile(r"^vllm_dp_exporter\.(0|[1-9][0-9]{0,3})\.json$")
#: A process's file larger than this is not read.
MAX_FILE_BYTES = 16 * 1024 * 1024
WARN_EVERY_S = 60.0


class ProcessShare:
    """This process's families, published; every process's, merged."""

    def __init__(
        self,
        directory: str,
        index: int,
        families: Callable[[], list[Family]],
        version: Callable[[], Hashable],
        *,
        count: int | None = None,
        stale_s: float = 60.0,
    ) -> None:
        """``index`` of ``count`` API servers (None: ``index + 1``, the fewest there can be)."""
        self.count = index + 1 if count is None else count
        if not 0 <= index < self.count:
            raise ValueError(f"API server index {index} is not below the count {self.count}")
        self.directory = Path(directory)
        self.index = index
        self.path = self.directory / f"vllm_dp_exporter.{index}.json"
        self._families = families
        self._version = version
        self._stale_s = stale_s
        self._written: Hashable = None
        self._warned: dict[str, float] = {}
        self._removed = False

    def snapshot(self) -> bytes | None:
        """This process's families as the file's bytes when they changed since the last
        write (or every ``stale_s / 3``, so the file never looks stale); None otherwise. On
        the loop: the state it reads changes on the loop."""
        version = (self._version(), int(time.monotonic() // max(1.0, self._stale_s / 3)))
        if version == self._written:
            return None
        self._written = version
        return families_to_json(self._families())

    def write(self, data: bytes) -> None:
        """Replace this process's file atomically (blocking: run it off the loop). A write
        still running in its thread when ``remove()`` ran (cancelling ``run`` does not stop
        the thread) removes what it wrote."""
        if self._removed:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)
        if self._removed:
            self.remove()

    async def run(self, interval_s: float) -> None:
        """Publish every ``interval_s`` when something changed."""
        while True:
            data = self.snapshot()
            if data is not None:
                try:
                    await asyncio.to_thread(self.write, data)
                except OSError as exc:
                    self._written = None
                    self._warn(str(self.path), f"cannot write {self.path}: {exc}")
            await asyncio.sleep(interval_s)

    def remove(self) -> None:
        """This process's file removed, and never written again."""
        self._removed = True
        with contextlib.suppress(OSError):
            self.path.unlink()

    def merged(self, own: list[Family]) -> list[Family]:
        """Every process's published families as one set (blocking file reads: call it off
        the loop). This process's own file is read too, not its live state: every process
        answering a scrape then sums the same snapshots, so a counter never goes back between
        two scrapes answered by different processes. ``own`` (taken on the loop) stands in
        until this process's first file is written."""
        published: dict[int, list[Family]] = {}
        now = time.time()
        try:
            entries = list(os.scandir(self.directory))
        except OSError as exc:
            self._warn(str(self.directory), f"cannot list {self.directory}: {exc}")
            entries = []
        for entry in entries:
            match = FILE.match(entry.name)
            if match is None:
                continue
            index = int(match.group(1))
            families = self._read(entry, now, index)
            if families is not None:
                published[index] = families
        published.setdefault(self.index, own)
        leader = published.pop(0 if 0 in published else self.index)
        return merge_processes(leader, list(published.values()))

    def _read(self, entry: os.DirEntry[str], now: float, index: int) -> list[Family] | None:
        try:
            info = entry.stat(follow_symlinks=False)
            stale = now - info.st_mtime > self._stale_s
            if index >= self.count:  # not this deployment's (a stale one: left in silence)
                if not stale:
                    self._warn(
                        entry.path,
                        f"{entry.path}: API server {index} is not one of this deployment's "
                        f"{self.count}; skipped",
                    )
                return None
            if not entry.is_file(follow_symlinks=False) or info.st_size > MAX_FILE_BYTES:
                self._warn(entry.path, f"{entry.path}: not a regular file under 16 MiB, skipped")
                return None
            if stale:
                return None  # a process that is gone (or stopped publishing)
            return families_from_json(read_regular(entry.path, MAX_FILE_BYTES + 1))
        except OSError:
            return None  # replaced or removed while read: the next scrape reads it
        except BadShare as exc:
            self._warn(entry.path, f"{entry.path}: {exc}; skipped")
            return None

    def _warn(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(key, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned[key] = now
            log.warning("%s", message)


def read_regular(path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of ``path``, a regular file checked on the opened descriptor
    (a file swapped for a FIFO or a link after the directory was listed is refused, never
    waited on); ``OSError`` otherwise."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        chunks, size = [], 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
