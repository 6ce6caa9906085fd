"""The state file is written off the event loop, coalesced: a burst of changes (every engine of a
large fleet handshaking) costs a few writes, the file always ends with the latest state, and a
shutdown waits for the last write. Real files in a temporary directory."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.state_check import SlotRecord, StateExpectation
from exporter.client.enginecore.state_file import StateSnapshot, StateWriter, load_state

INPUT = "tcp://127.0.0.1:7000"


def snapshot_of(engines: list[int]) -> StateSnapshot:
    records = [
        SlotRecord(i, f"{i:04x}", 1, f"tcp://127.0.0.1:{7001 + i}", "0.33.0", True) for i in engines
    ]
    return INPUT, {"handshake_address": "tcp://127.0.0.1:6999"}, records


def engines_in(path: Path) -> list[int]:
    return [e["engine_index"] for e in json.loads(path.read_text())["engines"]]


async def test_a_burst_of_changes_is_coalesced_and_ends_with_the_latest_state(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    up: list[int] = []
    writer = StateWriter(str(path), lambda: snapshot_of(list(up)), ProtocolErrorTally())
    for engine in range(1024):  # every engine comes up within one burst
        up.append(engine)
        writer.request()
        if engine % 64 == 0:
            await asyncio.sleep(0)  # the loop turns now and then, as during a real start-up
    await writer.flush()
    assert engines_in(path) == list(range(1024))
    assert 1 <= writer.writes <= 64, writer.writes  # far fewer writes than changes
    expect = StateExpectation(
        INPUT,
        1024,
        0,
        {i: (f"{i:04x}", f"tcp://127.0.0.1:{7001 + i}") for i in range(1024)},
        None,
    )
    restored, _ = load_state(str(path), expect)
    assert [r.engine_index for r in restored] == list(range(1024))
    assert restored[5].vllm_version == "0.33.0"


async def test_flush_writes_a_change_made_while_a_write_runs(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    up = [0]
    writer = StateWriter(str(path), lambda: snapshot_of(list(up)), ProtocolErrorTally())
    writer.request()
    await asyncio.sleep(0)  # the first write is in flight in its thread
    up.append(1)
    writer.request()
    await asyncio.wait_for(writer.flush(), 10)
    assert engines_in(path) == [0, 1]
    writes = writer.writes
    await writer.flush()  # nothing pending: no write
    assert writer.writes == writes


def test_without_an_event_loop_the_write_is_immediate(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    writer = StateWriter(str(path), lambda: snapshot_of([3]), ProtocolErrorTally())
    writer.request()
    assert engines_in(path) == [3] and writer.writes == 1


async def test_a_failing_snapshot_is_counted_and_a_later_change_still_writes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    faults = ProtocolErrorTally()
    broken = [True]

    def snapshot() -> StateSnapshot:
        if broken[0]:
            raise RuntimeError("bug in the snapshot")
        return snapshot_of([7])

    writer = StateWriter(str(path), snapshot, faults)
    writer.request()
    await writer.flush()
    assert faults.task_failures.get("state_file") == 1
    assert not path.exists()
    broken[0] = False
    writer.request()
    await writer.flush()
    assert engines_in(path) == [7]


async def test_an_unwritable_path_is_logged_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("a file where the directory should be")
    writer = StateWriter(
        str(tmp_path / "file" / "state.json"), lambda: snapshot_of([1]), ProtocolErrorTally()
    )
    writer.request()
    await writer.flush()
    assert "cannot write state file" in caplog.text
