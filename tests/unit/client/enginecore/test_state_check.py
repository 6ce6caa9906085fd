"""The state-file checks alone: what the writer writes is believed; input a hostile or broken
file can hold is refused with ``InvalidState`` and nothing else (no RecursionError, TypeError,
OverflowError), whatever its size limit. Real files in a temporary directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.client.enginecore.state_check import (
    InvalidState,
    SlotRecord,
    StateExpectation,
    parse_state,
    read_bounded,
)
from exporter.client.enginecore.state_file import write_state
from exporter.protocol import engine_identity

INPUT = "tcp://127.0.0.1:7000"


def expectation(count: int = 3, fixed_slot: int | None = 0) -> StateExpectation:
    engines = {i: (engine_identity(i).hex(), f"tcp://127.0.0.1:{7001 + i}") for i in range(count)}
    return StateExpectation(INPUT, count, 0, engines, fixed_slot)


def written(tmp_path: Path, slot: int = 0, count: int = 3) -> bytes:
    path = tmp_path / "state.json"
    records = [
        SlotRecord(i, engine_identity(i).hex(), slot, f"tcp://127.0.0.1:{7001 + i}", "0.33", True)
        for i in range(count)
    ]
    assert write_state(str(path), INPUT, {"engine_count": count, "start_rank": 0}, records) is None
    return path.read_bytes()


def test_what_the_writer_writes_is_believed_in_both_modes(tmp_path: Path) -> None:
    owner = parse_state(written(tmp_path, slot=0), expectation(fixed_slot=0))
    assert [(r.engine_index, r.client_index, r.vllm_version) for r in owner] == [
        (0, 0, "0.33"),
        (1, 0, "0.33"),
        (2, 0, "0.33"),
    ]
    relay = parse_state(written(tmp_path, slot=4), expectation(fixed_slot=None))
    assert {r.client_index for r in relay} == {4}


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000,
        b'{"a":' * 100_000,
        b'{"version": 1, "engines": ' + b"[" * 200_000,
    ],
    ids=["arrays", "objects", "inside_the_file"],
)
def test_deep_nesting_is_refused_without_a_recursion_error(data: bytes) -> None:
    with pytest.raises(InvalidState):
        parse_state(data, expectation())


@pytest.mark.parametrize(
    "data",
    [b"", b"null", b"5", b'"text"', b"[]", b"\xff\xfe", b"1" * 5000, b"NaN", b'{"version": true}'],
)
def test_anything_but_a_state_object_is_refused(data: bytes) -> None:
    with pytest.raises(InvalidState):
        parse_state(data, expectation())


def test_a_version_one_file_without_the_fleet_shape_is_still_believed(tmp_path: Path) -> None:
    """Files written before engine_count and start_rank were recorded."""
    state = json.loads(written(tmp_path))
    del state["engine_count"], state["start_rank"]
    assert len(parse_state(json.dumps(state).encode(), expectation())) == 3


def test_reads_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert read_bounded(str(path), 100) is None  # no file: a first start
    path.write_bytes(b"x" * 101)
    with pytest.raises(InvalidState, match="more than the 100"):
        read_bounded(str(path), 100)
    path.write_bytes(b"x" * 100)
    assert read_bounded(str(path), 100) == b"x" * 100
    with pytest.raises(InvalidState, match="not a regular file"):
        read_bounded(str(tmp_path), 100)
