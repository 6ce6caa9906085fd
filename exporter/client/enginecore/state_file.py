"""The small state file of owner and relay mode: what a restarted exporter needs to find its
engines again.

Engines handshake once; after an exporter restart on the same fixed addresses they reconnect at
the ZMQ level, but only the state file remembers which engines exist, which client slot the
exporter has on each, and what each said in its registration (vLLM version, sleep mode): the
engines never send that again. Written atomically (temp file + rename) so a crash never leaves
half a file; read back only after every field passed ``state_check``; guarded by an advisory
lock (``StateFileLock``) so that two exporters never share one file.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.links import EngineLink, Phase
from exporter.client.enginecore.state_check import (
    STATE_VERSION,
    InvalidState,
    SlotRecord,
    StateExpectation,
    parse_state,
    read_bounded,
    recorded_addresses,
)
from exporter.error import ConfigError
from exporter.protocol.handshake import RegistrationInfo
from exporter.protocol.pushes import FT_UNKNOWN, FaultStatus

log = logging.getLogger("exporter.transport")
#: The outcomes of one write, the labels of ``vllm_dp_state_file_writes_total``.
STATE_FILE_OUTCOMES = ("ok", "failed")


def write_state(
    path: str, input_address: str, extra: dict[str, Any], slots: list[SlotRecord]
) -> str | None:
    """Atomically replace the state file; None when written, else why not (never raised:
    polling goes on)."""
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
                "registration": dict(s.facts),
                "fault_tolerance": None
                if s.fault_status is None
                else {
                    "status": s.fault_status.status,
                    "fault_info": s.fault_status.fault_info,
                    "since_unix": s.fault_status.since_unix,
                },
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
    except OSError as exc:  # the reason only: the temporary file's random name would vary
        return exc.strerror or str(exc)
    return None


def load_state(path: str, expect: StateExpectation) -> tuple[list[SlotRecord], dict[str, str]]:
    """The engines a previous exporter process had slots on and the addresses it recorded
    (``state_check.RECORDED_ADDRESSES``; both empty without a file); InvalidState
    (``state_check``) when the file cannot be believed as a whole."""
    data = read_bounded(path, expect.size_limit)
    if data is None:
        return [], {}
    return parse_state(data, expect), recorded_addresses(data)


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
                reg.facts if reg else (),
                link.fault_status,
            )
        )
    return records


#: ``fault_info`` of an engine reattached after an exporter restart with no record of its status:
#: its state file had none for it, or the exporter runs without ``--state-file``.
NOT_KNOWN_SINCE_RESTART = "not known since the exporter restarted (no record in the state file)"
NOT_KNOWN_WITHOUT_STATE_FILE = "not known since the exporter restarted (no --state-file)"


def unknown_since_restart(with_state_file: bool = True) -> FaultStatus:
    """The status of an engine that reattaches without a handshake and without a record: it
    pushes only on change, so whatever it said before is lost (fail closed: not healthy). The
    reason says which: a file without its record, or no file at all."""
    why = NOT_KNOWN_SINCE_RESTART if with_state_file else NOT_KNOWN_WITHOUT_STATE_FILE
    return FaultStatus(FT_UNKNOWN, why, time.time())


def restore_links(records: Iterable[SlotRecord], links: Mapping[int, EngineLink]) -> list[int]:
    """Mark the links of validated records RESTORED, with their slot, registration details and
    fault-tolerance status (unknown where the file does not say); returns the engine indices
    restored."""
    restored = []
    for record in records:
        link = links[record.engine_index]
        link.slot = record.client_index
        link.phase = Phase.RESTORED
        link.registration = RegistrationInfo(
            vllm_version=record.vllm_version,
            enable_sleep_mode=record.enable_sleep_mode,
            facts=record.facts,
        )
        link.fault_status = (
            record.fault_status if record.fault_status_known else unknown_since_restart()
        )
        restored.append(link.engine_index)
    return restored


#: What one write records: the input address, the extra fields and the engines.
StateSnapshot = tuple[str, dict[str, Any], list[SlotRecord]]
#: ``vllm_dp_state_file_writes_total`` outcomes.
WRITE_OK, WRITE_FAILED = "ok", "failed"


class StateWriter:
    """Writes the state file off the event loop, one write at a time; changes made while a write
    runs are coalesced into the next one.

    Each write serialises every engine and fsyncs: done synchronously on every handshake step,
    they blocked the event loop for most of a large relay fleet's start-up (docs/scale.md,
    ``python -m bench.scale``). Now a change reaches the disk within the write in flight plus
    one write, and ``flush`` (at shutdown) waits for the last one. Every write is counted in
    ``outcomes`` (``ok`` / ``failed``); a failure is logged once until the reason changes or a
    write works again (a full disk would otherwise log on every handshake step)."""

    def __init__(
        self,
        path: str,
        snapshot: Callable[[], StateSnapshot],
        faults: ProtocolErrorTally,
        outcomes: Counter[str] | None = None,
    ) -> None:
        self.path = path
        self._snapshot = snapshot
        self._faults = faults
        self.outcomes: Counter[str] = outcomes if outcomes is not None else Counter()
        self._failing: str | None = None
        self._dirty = False
        self._task: asyncio.Task[None] | None = None
        #: Writes done (how much coalescing happened; tests/unit/client/test_state_file.py).
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
                error = await asyncio.to_thread(write_state, self.path, *snapshot)
            except Exception as exc:  # a bug: count it; the next change tries again
                self._faults.task_failed("state_file", exc)
                self._record(str(exc))
                return
            self._record(error)

    def _write_now(self) -> None:
        self._dirty = False
        self._record(write_state(self.path, *self._snapshot()))

    def _record(self, error: str | None) -> None:
        self.writes += 1
        self.outcomes[WRITE_FAILED if error else WRITE_OK] += 1
        if error is None:
            if self._failing is not None:
                log.info("state file %s written again", self.path)
            self._failing = None
        elif error != self._failing:
            self._failing = error
            log.error(
                "cannot write state file %s: %s (a restarted exporter will not find its "
                'engines; vllm_dp_state_file_writes_total{outcome="failed"})',
                self.path,
                error,
            )

    async def flush(self) -> None:
        """Wait for the write in flight (never cancelled midway) and write what is pending."""
        task, self._task = self._task, None
        if task is not None:
            await asyncio.shield(task)  # _run counts its own failures: it never raises
        if self._dirty:
            self._write_now()


class StateFileLock:
    """An advisory lock (``flock``) on ``<state file>.lock``, held while the transport runs.

    Two exporters writing one state file overwrite each other's engines, and the one restarted
    next reads the other's addresses: the second to start refuses, naming the holder (the lock
    file says which process on which host). The kernel drops the lock when the process dies,
    so a crashed exporter never blocks its successor; the file itself stays."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, state_path: str) -> StateFileLock | None:
        """The lock; ConfigError when another live exporter holds it; None (with a warning)
        when no lock can be taken here (the exporter still runs, unguarded)."""
        path = f"{state_path}.lock"
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            log.warning(
                "cannot create %s (%s): a second exporter on state file %s would go unnoticed",
                path,
                exc.strerror or exc,
                state_path,
            )
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 200).decode("utf-8", "replace").splitlines()
            holder = (text[0].strip()[:100] if text else "") or "unknown process"
            os.close(fd)
            raise ConfigError(
                f"--state-file {state_path} is in use by another exporter ({holder}, lock "
                f"{path}): give every exporter its own state file"
            ) from None
        except OSError as exc:  # a file system without locks
            os.close(fd)
            log.warning("cannot lock %s (%s): a second exporter would go unnoticed", path, exc)
            return None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return cls(fd, path)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the lock


class StateFile:
    """One transport's state file: its lock, its coalesced writes (counted in ``outcomes``,
    from 0) and the restore of what a previous process wrote. Without a path (no
    ``--state-file``) every method does nothing."""

    def __init__(
        self,
        path: str | None,
        snapshot: Callable[[], StateSnapshot],
        faults: ProtocolErrorTally,
        outcomes: Counter[str],
    ) -> None:
        self.path = path
        outcomes.update(dict.fromkeys(STATE_FILE_OUTCOMES, 0))
        self._writer = StateWriter(path, snapshot, faults, outcomes) if path else None
        self._lock: StateFileLock | None = None
        #: The addresses the restored file recorded (``state_check.RECORDED_ADDRESSES``).
        self.recorded: dict[str, str] = {}

    def lock(self) -> None:
        """Take the lock (before any bind: a refusal, ConfigError, leaves no trace)."""
        if self.path:
            self._lock = StateFileLock.acquire(self.path)

    def request(self) -> None:
        """Write the current state soon (``StateWriter``)."""
        if self._writer is not None:
            self._writer.request()

    async def close(self) -> None:
        """Wait for the last write, then let the lock go."""
        if self._writer is not None:
            await self._writer.flush()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def restore(
        self, links: Mapping[int, EngineLink], expect: StateExpectation, ignored: str
    ) -> list[int]:
        """Restore the links a believable state file records (``restore_links``); a file that
        cannot be believed is ignored as a whole, with one warning naming it, the reason and
        what ignoring it means in this mode (``ignored``)."""
        if not self.path:
            return []
        try:
            records, self.recorded = load_state(self.path, expect)
        except InvalidState as exc:
            log.warning("state file %s ignored: %s; %s", self.path, exc, ignored)
            return []
        restored = restore_links(records, links)
        if restored:
            log.info("restored engines %s from %s without a handshake", restored, self.path)
        return restored
