"""The relay's small state file: what a restarted exporter needs to find its engines again.

Engines handshake once; after an exporter restart on the same fixed addresses they reconnect at
the ZMQ level, but only the state file remembers which engines exist and which client slot the
exporter has on each. Written atomically (temp file + rename) so a crash never leaves half a file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("exporter.transport.relay")

STATE_VERSION = 1


@dataclass(frozen=True, slots=True)
class SlotRecord:
    engine_index: int
    identity_hex: str
    client_index: int
    output_address: str


def write_state(
    path: str, input_address: str, extra: dict[str, Any], slots: list[SlotRecord]
) -> None:
    """Atomically replace the state file; errors are logged, never raised (the relay goes on)."""
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
            }
            for s in slots
        ],
    }
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".relay-state-", dir=target.parent)
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
        log.error("relay: cannot write state file %s: %s", path, exc)


def read_state(path: str, input_address: str) -> list[SlotRecord]:
    """The engines a previous exporter process had slots on; [] when the file does not apply."""
    if not Path(path).exists():
        return []
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        log.warning("relay: ignoring unreadable state file %s: %s", path, exc)
        return []
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        log.warning("relay: ignoring state file %s of an unknown version", path)
        return []
    if state.get("input_address") != input_address:
        log.warning(
            "relay: state file %s was written for input %s, now %s: engines cannot reconnect "
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
            log.warning("relay: ignoring malformed state file entry %r", entry)
            continue
        records.append(SlotRecord(index, entry["identity"], slot, entry["output_address"]))
    return records
