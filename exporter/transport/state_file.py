"""The small state file of owner and relay mode: what a restarted exporter needs to find its
engines again.

Engines handshake once; after an exporter restart on the same fixed addresses they reconnect at
the ZMQ level, but only the state file remembers which engines exist, which client slot the
exporter has on each, and what each said in its registration (vLLM version, sleep mode): the
engines never send that again. Written atomically (temp file + rename) so a crash never leaves
half a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exporter.faults import ProtocolErrorTally
from exporter.protocol.handshake import MAX_REGISTRATION_STRING, RegistrationInfo
from exporter.transport.links import EngineLink, Phase

log = logging.getLogger("exporter.transport")

STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class SlotRecord:
    engine_index: int
    identity_hex: str
    client_index: int
    output_address: str
    vllm_version: str | None = None
    enable_sleep_mode: bool | None = None


def write_state(
    path: str, input_address: str, extra: dict[str, Any], slots: list[SlotRecord]
) -> None:
    """Atomically replace the state file; errors are logged, never raised (polling goes on)."""
    target = Path(path)
    state = {
        "version": STATE_VERSION,
        "input_address": input_address,
        **extra,
        "engines": [
            {
                "engine_index": s.engine_index,
                "identity": s.identity_hex,
                "client_index": s.client_index,
                "output_address": s.output_address,
                "vllm_version": s.vllm_version,
                "enable_sleep_mode": s.enable_sleep_mode,
            }
            for s in slots
        ],
    }
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".exporter-state-", dir=target.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(state, f, indent=1, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        log.error("state file: cannot write state file %s: %s", path, exc)


def read_state(path: str, input_address: str) -> list[SlotRecord]:
    """The engines a previous exporter process had slots on; [] when the file does not apply."""
    if not Path(path).exists():
        return []
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        log.warning("state file: ignoring unreadable state file %s: %s", path, exc)
        return []
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        log.warning("state file: ignoring state file %s of an unknown version", path)
        return []
    if state.get("input_address") != input_address:
        log.warning(
            "state file: state file %s was written for input %s, now %s: engines cannot reconnect "
            "(use --fixed-base-port); ignoring it",
            path,
            state.get("input_address"),
            input_address,
        )
        return []
    records = []
    for entry in state.get("engines") or []:
        if not isinstance(entry, dict):
            continue
        index, slot = entry.get("engine_index"), entry.get("client_index")
        if (
            not isinstance(index, int)
            or not isinstance(slot, int)
            or isinstance(slot, bool)
            or slot < 0
            or not isinstance(entry.get("identity"), str)
            or not isinstance(entry.get("output_address"), str)
        ):
            log.warning("state file: ignoring malformed state file entry %r", entry)
            continue
        version = entry.get("vllm_version")
        sleep_mode = entry.get("enable_sleep_mode")
        records.append(
            SlotRecord(
                index,
                entry["identity"],
                slot,
                entry["output_address"],
                version[:MAX_REGISTRATION_STRING] if isinstance(version, str) else None,
                sleep_mode if isinstance(sleep_mode, bool) else None,
            )
        )
    return records


def records_of(links: Iterable[EngineLink]) -> list[SlotRecord]:
    """The engines worth remembering: those with a slot that are (or were just) up."""
    records = []
    for link in links:
        restorable = link.phase in (Phase.UP, Phase.RESTORED, Phase.LOST) or (
            link.phase is Phase.INIT_SENT and link.ready
        )
        if link.slot is None or not restorable:
            continue
        reg = link.registration
        records.append(
            SlotRecord(
                link.engine_index,
                link.identity.hex(),
                link.slot,
                link.output_address,
                reg.vllm_version if reg else None,
                reg.enable_sleep_mode if reg else None,
            )
        )
    return records


def restore_links(records: Iterable[SlotRecord], links: Mapping[int, EngineLink]) -> list[int]:
    """Mark the links the records match RESTORED, with their slot and registration details;
    returns the engine indices restored (records that do not match are logged and skipped)."""
    restored = []
    for record in records:
        link = links.get(record.engine_index)
        if (
            link is None
            or record.identity_hex != link.identity.hex()
            or record.output_address != link.output_address
        ):
            log.warning("state file entry %r does not match this exporter", record)
            continue
        link.slot = record.client_index
        link.phase = Phase.RESTORED
        link.registration = RegistrationInfo(
            vllm_version=record.vllm_version, enable_sleep_mode=record.enable_sleep_mode
        )
        restored.append(link.engine_index)
    return restored


#: What one write records: the input address, the extra addresses and the engines.
StateSnapshot = tuple[str, dict[str, Any], list[SlotRecord]]


class StateWriter:
    """Writes the state file off the event loop, one write at a time; changes made while a write
    runs are coalesced into the next one.

    Each write serialises every engine and fsyncs: done synchronously on every handshake step,
    a 1,024-engine relay start-up spent most of its minutes blocked in thousands of them. Now a
    change reaches the disk within the write in flight plus one write (milliseconds), and
    ``flush`` (at shutdown) waits for the last one."""

    def __init__(
        self, path: str, snapshot: Callable[[], StateSnapshot], faults: ProtocolErrorTally
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        self._faults = faults
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        #: Writes done (how much coalescing happened; tests/core/test_state_writer.py).
        self.writes = 0

    def request(self) -> None:
        """Record the current state soon (now, when no event loop runs)."""
        self._dirty = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_now()
            return
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run())

    async def _run(self) -> None:
        while self._dirty:
            self._dirty = False
            try:
                snapshot = self._snapshot()  # on the loop: links are never read from a thread
                await asyncio.to_thread(write_state, self.path, *snapshot)
            except Exception as exc:  # a bug: count it; the next change tries again
                self._faults.task_failed("state_file", exc)
                return
            self.writes += 1

    def _write_now(self) -> None:
        self._dirty = False
        write_state(self.path, *self._snapshot())
        self.writes += 1

    async def flush(self) -> None:
        """Wait for the write in flight (never cancelled midway) and write what is pending."""
        task, self._task = self._task, None
        if task is not None:
            await asyncio.shield(task)  # _run counts its own failures: it never raises
        if self._dirty:
            self._write_now()
