"""A restarted exporter trusts its state file only as far as what is possible: an entry or a file
that could not have been written for these engines is ignored as a whole, with one warning
naming the file and the reason. The engines are never sent an index they did not give (a vLLM
engine's output thread dies on an out-of-range client_index, and only a restart revives it),
the exporter starts, and its polls go on.

Owner and relay mode over simulated engines that keep running across the restart (real ZMQ on
127.0.0.1, fixed ports, ``tests/harness/restart.py``); every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from exporter.client.enginecore.dataplane import EngineDataPlane
from exporter.client.fleet import connected_count
from tests.harness.relay import cross_talk
from tests.harness.restart import VLLM_VERSION, RestartRig, answering
from tests.harness.service import Service
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(30)

Damage = Callable[[RestartRig, dict[str, Any]], None]

#: (field, value) put into one engine's entry; owner mode's slot on every engine is 0.
OWNER_ENTRY_DAMAGE: dict[str, tuple[str, Any]] = {
    "slot_beyond_the_engines_clients": ("client_index", 3),
    "slot_other_than_zero": ("client_index", 1),
    "slot_10e30": ("client_index", 10**30),
    "negative_slot": ("client_index", -1),
    "slot_as_text": ("client_index", "0"),
    "slot_as_bool": ("client_index", False),
    "slot_as_float": ("client_index", 0.0),
    "no_slot": ("client_index", None),
    "engine_outside_the_fleet": ("engine_index", 7),
    "identity_of_another_engine": ("identity", "0900"),
    "identity_as_number": ("identity", 5),
    "output_address_elsewhere": ("output_address", "tcp://127.0.0.1:1"),
    "version_of_ten_thousand_characters": ("vllm_version", "v" * 10_000),
    "sleep_mode_as_text": ("enable_sleep_mode", "yes"),
}
#: Relay mode: the slot is the front end's client count (1 here): the same on every engine.
RELAY_ENTRY_DAMAGE: dict[str, tuple[str, Any]] = {
    "slot_beyond_the_engines_clients": ("client_index", 2),
    "slot_of_the_front_end": ("client_index", 0),
    "slot_10e30": ("client_index", 10**30),
    "negative_slot": ("client_index", -1),
    "slot_as_text": ("client_index", "1"),
    "slot_as_bool": ("client_index", True),
}
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def _write(rig: RestartRig, state: Any) -> None:
    rig.path.write_text(json.dumps(state))


def _engines_not_a_list(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "engines": 5})


def _deeply_nested(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.write_text("[" * 100_000)


def _nested_inside_an_entry(rig: RestartRig, state: dict[str, Any]) -> None:
    # Small enough for any size bound: only the structure is wrong.
    state["engines"][1]["vllm_version"] = json.loads("[" * 50 + "]" * 50)
    _write(rig, state)


def _ten_megabytes(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.write_text(json.dumps(state) + " " * (10 * 1024 * 1024))


def _another_engine_count(rig: RestartRig, state: dict[str, Any]) -> None:
    extra = dict(state["engines"][-1])
    extra.update(engine_index=3, identity="0300", output_address=f"tcp://127.0.0.1:{rig.base + 4}")
    _write(rig, {**state, "engine_count": 4, "engines": [*state["engines"], extra]})


def _another_start_rank(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "start_rank": 1})


def _another_input_address(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "input_address": "tcp://127.0.0.1:1"})


def _every_slot_beyond_any_front_end(rig: RestartRig, state: dict[str, Any]) -> None:
    for entry in state["engines"]:
        entry["client_index"] = 100_000
    _write(rig, state)


def _a_directory(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.unlink()
    rig.path.mkdir()


def _a_fifo(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.unlink()
    os.mkfifo(rig.path)  # a naive read would block the start-up forever


def _a_symlink_loop(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.unlink()
    rig.path.symlink_to(rig.path)


def _not_json(rig: RestartRig, state: dict[str, Any]) -> None:
    rig.path.write_bytes(b"\xff\xfe\x00 not json \x80")


def _unknown_version(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "version": 2})


def _unknown_field(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "owner": {"note": "not written by an exporter"}})


def _engine_listed_twice(rig: RestartRig, state: dict[str, Any]) -> None:
    _write(rig, {**state, "engines": [*state["engines"], state["engines"][0]]})


FILE_DAMAGE: dict[str, Damage] = {
    "engines_not_a_list": _engines_not_a_list,
    "deeply_nested": _deeply_nested,
    "nested_inside_an_entry": _nested_inside_an_entry,
    "ten_megabytes": _ten_megabytes,
    "another_engine_count": _another_engine_count,
    "another_start_rank": _another_start_rank,
    "another_input_address": _another_input_address,
    "a_directory": _a_directory,
    "a_fifo": _a_fifo,
    "a_symlink_loop": _a_symlink_loop,
    "not_json": _not_json,
    "unknown_version": _unknown_version,
    "unknown_field": _unknown_field,
    "engine_listed_twice": _engine_listed_twice,
}
RELAY_FILE_DAMAGE: dict[str, Damage] = {
    **FILE_DAMAGE,
    "every_slot_beyond_any_front_end": _every_slot_beyond_any_front_end,
}


@pytest.fixture
async def make_rig(tmp_path: Path) -> AsyncIterator[Callable[[str], RestartRig]]:
    rigs: list[RestartRig] = []

    def make(mode: str) -> RestartRig:
        rigs.append(RestartRig(mode, tmp_path))
        return rigs[-1]

    yield make
    for rig in rigs:
        await rig.close()


def _state_file_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "state file" in r.getMessage().lower()
    ]


async def _restart_on_damaged_file(
    rig: RestartRig, damage: Damage, caplog: pytest.LogCaptureFixture
) -> Service:
    """Damage the state file the first exporter wrote; start the next exporter on it, wait for
    polls; check what holds whatever the damage: one warning, polls counted, engines healthy,
    nothing restored and never an impossible index sent."""
    state = await rig.first_run()
    answered = rig.frontend_answers() if rig.mode == "relay" else []
    damage(rig, state)
    caplog.clear()
    service = await rig.start()  # starts: no crash, whatever the file
    await service.next_polls(3)
    assert service.exporter.stats.polls >= 3, "polls are counted"
    warnings = _state_file_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(rig.path) in warnings[0], warnings[0]
    if rig.mode == "owner":
        # Fixed ports: every engine reattaches on slot 0, without what the file said.
        await eventually(lambda: answering(service), 5, "reattached and answering")
        await service.next_polls(2)
        assert [e.up for e in service.exporter.poller.snapshot.engines] == [True] * 3
        assert [d.vllm_version for d in service.client.engine_details()] == [None] * 3
    else:
        # Nothing restored: the exporter cannot call them until they handshake again; the
        # front end's own calls go on being answered by every engine.
        transport = service.client.transport
        assert isinstance(transport, EngineDataPlane)
        assert connected_count(service.client) == 0
        assert not any(transport.is_callable(i) for i in range(3))
        await eventually(
            lambda: all(
                now >= before + 5
                for now, before in zip(rig.frontend_answers(), answered, strict=True)
            ),
            5,
            "every engine still answers the front end",
        )
        assert rig.frontend is not None and cross_talk(rig.frontend.faults) == {}
    assert rig.healthy(), "an engine's input or output thread died"
    assert rig.indices_received() <= rig.slots, rig.indices_received()
    return service


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", list(OWNER_ENTRY_DAMAGE))
async def test_owner_restart_ignores_a_state_file_with_an_impossible_entry(
    make_rig: Callable[[str], RestartRig],
    caplog: pytest.LogCaptureFixture,
    kind: str,
    position: str,
) -> None:
    key, value = OWNER_ENTRY_DAMAGE[kind]

    def damage(rig: RestartRig, state: dict[str, Any]) -> None:
        state["engines"][POSITIONS[position]][key] = value
        _write(rig, state)

    await _restart_on_damaged_file(make_rig("owner"), damage, caplog)


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("kind", list(RELAY_ENTRY_DAMAGE))
async def test_relay_restart_ignores_a_state_file_with_an_impossible_entry(
    make_rig: Callable[[str], RestartRig],
    caplog: pytest.LogCaptureFixture,
    kind: str,
    position: str,
) -> None:
    key, value = RELAY_ENTRY_DAMAGE[kind]

    def damage(rig: RestartRig, state: dict[str, Any]) -> None:
        state["engines"][POSITIONS[position]][key] = value
        _write(rig, state)

    await _restart_on_damaged_file(make_rig("relay"), damage, caplog)


@pytest.mark.parametrize("kind", list(FILE_DAMAGE))
async def test_owner_restart_ignores_a_malformed_state_file(
    make_rig: Callable[[str], RestartRig], caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    await _restart_on_damaged_file(make_rig("owner"), FILE_DAMAGE[kind], caplog)


@pytest.mark.parametrize("kind", list(RELAY_FILE_DAMAGE))
async def test_relay_restart_ignores_a_malformed_state_file(
    make_rig: Callable[[str], RestartRig], caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    await _restart_on_damaged_file(make_rig("relay"), RELAY_FILE_DAMAGE[kind], caplog)


@pytest.mark.parametrize("mode", ["owner", "relay"])
async def test_an_intact_state_file_is_restored_without_a_warning(
    make_rig: Callable[[str], RestartRig], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    """The checks reject nothing the exporter itself writes."""
    rig = make_rig(mode)
    await rig.first_run()
    caplog.clear()
    service = await rig.start()
    await eventually(lambda: answering(service), 5, "reattached and answering")
    await service.next_polls(2)
    assert [e.up for e in service.exporter.poller.snapshot.engines] == [True] * 3
    assert [d.vllm_version for d in service.client.engine_details()] == [VLLM_VERSION] * 3
    assert [d.handshakes for d in service.client.engine_details()] == [0] * 3
    assert _state_file_warnings(caplog) == []
    assert rig.healthy()
    assert rig.indices_received() <= rig.slots
