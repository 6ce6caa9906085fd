"""One poller per deployment of several API server processes: the reading file they share.

API server 0 writes each poll's reading to ``vllm_dp_exporter.reading.json`` in
``PROMETHEUS_MULTIPROC_DIR`` (atomically, off vLLM's event loop); the other API servers read it
each poll instead of asking every engine (``exporter.control.sources``). The file is read
bounded, from a regular file only (``read_regular``): a FIFO or a link there is refused, never
waited on.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from exporter.inprocess.shared import read_regular

READING_FILE = "vllm_dp_exporter.reading.json"
#: A reading larger than this is not read (256 engines' five reads take about 100 KB).
MAX_READING_BYTES = 4 * 1024 * 1024


class ReadingFile:
    """The deployment's reading in ``directory``: written by the leader, read by the rest."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / READING_FILE
        self._removed = False

    async def publish(self, data: bytes) -> None:
        await asyncio.to_thread(self._write, data)

    def _write(self, data: bytes) -> None:
        if self._removed:  # a write still in its thread when the leader stopped
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.path)

    async def load(self) -> bytes | None:
        """The file's bytes; None when there is none; ``OSError`` when it cannot be read or
        is larger than ``MAX_READING_BYTES``."""
        return await asyncio.to_thread(self._read)

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
