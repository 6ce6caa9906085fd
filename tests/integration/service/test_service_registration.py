"""What each engine says about itself when it registers, over real HTTP and real ZMQ (owner
mode, simulated engines): every ``REGISTRATION_FACTS`` key in /status (null when not sent) and
``vllm_dp_engine_info`` for every engine (``unknown`` for what it did not send), side by side
for vLLM 0.20's three-key registration and 0.33's full map; hostile values are dropped or cut;
the facts survive an exporter restart through ``--state-file``, and a state file whose
``registration`` could not have been written by an exporter is ignored with one warning.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from exporter.client.fleet import REGISTRATION_KEYS, connected_count
from exporter.metrics.catalog import INFO_FACTS
from exporter.protocol.handshake import LEGACY_REGISTRATION_KEYS, MAX_REGISTRATION_STRING
from exporter.sim.options import SimOptions
from tests.harness.restart import VLLM_VERSION, IndexRecordingEngine, RestartRig, answering
from tests.harness.scrape import Families
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

INFO = "vllm_dp_engine_info"


def info(m: Families) -> dict[str, dict[str, str]]:
    """engine → the labels of its one info series (value 1)."""
    found: dict[str, dict[str, str]] = {}
    for s in m[INFO].samples:
        assert s.value == 1.0 and s.labels["engine"] not in found, s
        found[s.labels["engine"]] = {k: v for k, v in s.labels.items() if k != "engine"}
    return found


async def registrations(svc: Service) -> list[dict[str, Any]]:
    doc = await svc.status()
    validate_status(doc)
    for e in doc["engines"]:
        assert list(e["registration"]) == list(REGISTRATION_KEYS), e["registration"]
    return [e["registration"] for e in doc["engines"]]


def full_info(index: int, version: str = "0.33.0") -> dict[str, str]:
    return {
        "vllm_version": version,
        # Owner mode reads the engines with no API server in the way.
        "front_end": "unknown",
        "rust_frontend_version": "unknown",
        "enable_sleep_mode": "true",
        "data_parallel_rank": str(index),
        "tensor_parallel_size": "1",
        "pipeline_parallel_size": "1",
        "dtype": "bfloat16",
    }


async def test_a_legacy_registration_beside_full_ones(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, per_engine={"registration_keys": {1: LEGACY_REGISTRATION_KEYS}})
    m = await fleet.scrape()
    assert info(m) == {
        "0": full_info(0),
        "1": dict.fromkeys(INFO_FACTS, "unknown"),
        "2": full_info(2),
    }
    regs = await registrations(fleet)
    assert regs[1] == {
        **dict.fromkeys(REGISTRATION_KEYS),
        "max_model_len": 4096,
        "num_gpu_blocks": 1000,
    }  # dp_stats_address was sent as nil: unknown like the keys that were not sent
    for index in (0, 2):
        reg = regs[index]
        assert (reg["vllm_version"], reg["dtype"], reg["data_parallel_rank"]) == (
            "0.33.0",
            "bfloat16",
            index,
        )
        assert reg["enable_sleep_mode"] is True and reg["supports_lora"] is False
        assert (reg["max_num_seqs"], reg["block_size"], reg["instance_id"]) == (256, 16, "abc")
        assert reg["dp_stats_address"] is None and reg["kv_cache_size_tokens"] is None
    doc = await fleet.status()
    assert [e["vllm_version"] for e in doc["engines"]] == ["0.33.0", None, "0.33.0"]
    assert [e["up"] for e in doc["engines"]] == [True] * 3
    # Its registration says nothing of sleep mode: it is asked like the others (and sleeps).
    assert fleet.admin_url is not None
    async with fleet.session.post(fleet.admin_url + "/admin/sleep") as resp:
        assert resp.status == 200, await resp.text()
    assert [e.calls_by_method.get("sleep", 0) for e in fleet.engines] == [1, 1, 1]


MEGABYTE = "x" * 1_000_000
#: (registration key, hostile value, what /status then shows for that key)
HOSTILE: dict[str, tuple[str, Any, Any]] = {
    "int_as_text": ("max_model_len", "4096", None),
    "int_as_bool": ("tensor_parallel_size", True, None),
    "int_as_float": ("pipeline_parallel_size", 1.0, None),
    "int_beyond_64_bits": ("data_parallel_rank", 2**64 - 1, None),
    "bool_as_int": ("enable_sleep_mode", 1, None),
    "version_as_list": ("vllm_version", ["0.33.0"], None),
    "megabyte_string": ("dtype", MEGABYTE, MEGABYTE[:MAX_REGISTRATION_STRING]),
    "nested": ("dtype", {"a": [[[["bfloat16"]]]] * 100}, None),
    "label_breaking": ("dtype", 'bf16"}\n# HELP vllm_dp_x y\n', 'bf16"}\n# HELP vllm_dp_x y\n'),
}


@pytest.mark.parametrize("case", HOSTILE.values(), ids=HOSTILE.keys())
async def test_hostile_registration_values_are_dropped_or_cut(
    fleet_factory: ServiceFactory, case: tuple[str, Any, Any]
) -> None:
    key, hostile, shown = case
    fleet = await fleet_factory(3, per_engine={"registration_extra": {1: {key: hostile}}})
    regs = await registrations(fleet)
    assert regs[1][key] == shown
    assert regs[0][key] is not None and regs[2][key] is not None  # the others' own values
    for other in set(REGISTRATION_KEYS) - {key, "data_parallel_rank"}:
        assert regs[1][other] == regs[0][other], other  # the rest of it still counts
    text = await fleet.metrics()
    assert not any(line.startswith("# HELP vllm_dp_x") for line in text.splitlines())
    m = await fleet.scrape()
    assert "vllm_dp_x" not in m  # nothing of a value escapes its label
    labels = info(m)
    assert set(labels) == {"0", "1", "2"}
    if key in INFO_FACTS:
        expected = "unknown" if shown is None else shown
        if isinstance(shown, bool):
            expected = str(shown).lower()
        assert labels["1"][key] == expected
        assert labels["0"][key] == full_info(0)[key]
    assert len(text) < 50_000
    doc = await fleet.status()
    assert [e["up"] for e in doc["engines"]] == [True] * 3
    assert len(json.dumps(doc)) < 200_000
    await fleet.next_polls()
    assert fleet.exporter.poller.snapshot.engines[1].up


# -- across an exporter restart (fixed ports, a state file) ----------------------------------


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[RestartRig]:
    made = RestartRig("owner", tmp_path)
    yield made
    await made.close()


async def first_run(rig: RestartRig, options: dict[int, SimOptions]) -> dict[str, Any]:
    """``RestartRig.first_run`` with each engine's own options: the first exporter handshakes
    every engine, writes its state file and is stopped; returns its last /status."""
    first = await rig.start()
    for index in range(rig.engine_count):
        opts = options.get(index, SimOptions(vllm_version=VLLM_VERSION))
        engine = IndexRecordingEngine(rig.handshake, index, opts)
        rig.engines.append(engine)
        rig.tasks.append(asyncio.create_task(engine.run()))
    await eventually(lambda: connected_count(first.client) == rig.engine_count, 10, "handshakes")
    await eventually(
        lambda: len(rig.recorded().get("engines", [])) == rig.engine_count, 5, "the state file"
    )
    await first.next_polls()
    doc = await first.status()
    await first.stop()
    return doc


async def restarted(rig: RestartRig) -> Service:
    second = await rig.start()
    # Connected once their connections are back; reattached once they answer.
    await eventually(lambda: answering(second), 5, "reattached")
    await second.next_polls(2)
    assert [e.up for e in second.exporter.poller.snapshot.engines] == [True] * 3
    return second


async def test_registration_facts_survive_an_exporter_restart(rig: RestartRig) -> None:
    before = await first_run(
        rig,
        {
            1: SimOptions(registration_keys=LEGACY_REGISTRATION_KEYS),
            2: SimOptions(vllm_version="0.33.1+cu129", enable_sleep_mode=False),
        },
    )
    written = {e["engine_index"]: e["registration"] for e in rig.recorded()["engines"]}
    assert written[1] == {"max_model_len": 4096, "num_gpu_blocks": 1000}
    assert written[2]["enable_sleep_mode"] is False and written[2]["dtype"] == "bfloat16"
    second = await restarted(rig)
    assert [d.handshakes for d in second.client.engine_details()] == [0, 0, 0]  # no handshake
    after = await registrations(second)
    assert after == [e["registration"] for e in before["engines"]]
    assert after[2]["vllm_version"] == "0.33.1+cu129"
    m = await second.scrape()
    assert info(m) == {
        "0": full_info(0, VLLM_VERSION),
        "1": dict.fromkeys(INFO_FACTS, "unknown"),
        "2": {**full_info(2, "0.33.1+cu129"), "enable_sleep_mode": "false"},
    }
    assert rig.healthy()


async def test_the_longest_registration_strings_survive_an_exporter_restart(
    rig: RestartRig, caplog: pytest.LogCaptureFixture
) -> None:
    """Every string fact at its longest, of characters JSON escapes as 12 bytes each: the
    state file the exporter writes must be one it reads back."""
    wide = "\U0001d4c1" * 1000
    strings = ("dtype", "dp_stats_address", "instance_id", "weight_transfer_backend")
    extra = {key: wide for key in (*strings, "vllm_version")}
    before = await first_run(rig, {i: SimOptions(registration_extra=extra) for i in range(3)})
    cut = wide[:MAX_REGISTRATION_STRING]
    assert all(e["registration"]["dtype"] == cut for e in before["engines"])
    caplog.clear()
    second = await restarted(rig)
    ignored = [r.getMessage() for r in caplog.records if "state file" in r.getMessage()]
    assert ignored == [], ignored
    assert await registrations(second) == [e["registration"] for e in before["engines"]]


#: ``registration`` of engine 1's entry → what the warning says.
BAD_FILE_REGISTRATION: dict[str, tuple[Any, str]] = {
    "a_list": (["bfloat16"], "is not a map"),
    "a_string": ("bfloat16", "is not a map"),
    "a_number": (4096, "is not a map"),
    "more_keys_than_there_are_facts": ({f"k{i}": i for i in range(40)}, "is not a map"),
    "an_unknown_key": ({"max_model_len": 4096, "owner": "me"}, "has unknown fields ['owner']"),
    "int_as_text": ({"max_model_len": "4096"}, "has bad values"),
    "int_as_bool": ({"tensor_parallel_size": True}, "has bad values"),
    "int_as_float": ({"num_gpu_blocks": 1000.0}, "has bad values"),
    "bool_as_int": ({"enable_sleep_mode": 1}, "has bad values"),
    "a_null": ({"dtype": None}, "has bad values"),
    "nested": ({"dtype": {"a": ["b"]}}, "has bad values"),
    "int_beyond_64_bits": ({"max_model_len": 2**70}, "has bad values"),
}


@pytest.mark.parametrize("case", BAD_FILE_REGISTRATION.values(), ids=BAD_FILE_REGISTRATION.keys())
async def test_a_state_file_with_an_impossible_registration_is_ignored(
    rig: RestartRig, caplog: pytest.LogCaptureFixture, case: tuple[Any, str]
) -> None:
    bad, why = case
    state = await rig.first_run()
    assert all(isinstance(e["registration"], dict) for e in state["engines"])
    state["engines"][1]["registration"] = bad
    rig.path.write_text(json.dumps(state))
    caplog.clear()
    second = await restarted(rig)
    warnings = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "state file" in r.getMessage()
    ]
    assert len(warnings) == 1, warnings
    assert str(rig.path) in warnings[0] and "ignored" in warnings[0], warnings[0]
    assert "engine 1's registration" in warnings[0] and why in warnings[0], warnings[0]
    # The whole file is ignored: no engine keeps what it said (not even the intact entries).
    assert [d.vllm_version for d in second.client.engine_details()] == [None] * 3
    regs = await registrations(second)
    assert regs == [dict.fromkeys(REGISTRATION_KEYS)] * 3
    assert info(await second.scrape()) == {}  # no engine's info series
    assert rig.healthy() and rig.indices_received() <= rig.slots
