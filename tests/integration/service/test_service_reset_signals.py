"""Signals routers reconcile on, over real HTTP and real ZMQ (owner mode, simulated engines):
each engine's confirmed prefix-cache resets (``vllm_dp_prefix_cache_last_reset_timestamp_seconds``,
``vllm_dp_prefix_cache_confirmed_resets_total``, ``/status``), whatever action ran them, and
each engine's KV-events publisher from its registration (``/status``, ``GET /kv_events_targets``).
"""

from __future__ import annotations

from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.protocol.kv_events import MAX_ENDPOINT
from exporter.sim.options import SimOptions
from tests.harness.scrape import Families, metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

GAUGE = "vllm_dp_prefix_cache_last_reset_timestamp_seconds"
COUNTER = "vllm_dp_prefix_cache_confirmed_resets_total"
#: ``--kv-events-config`` as an operator gives it to every engine.
KV_EVENTS = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": "tcp://*:5600",
    "topic": "kv",
}


async def post(svc: Service, action: str, **params: str) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/{action}", params=params) as resp:
        return resp.status, await resp.json()


def counts(m: Families) -> dict[str, float]:
    return {s.labels["engine"]: s.value for s in m["vllm_dp_prefix_cache_confirmed_resets"].samples}


def stamps(m: Families) -> dict[str, float]:
    return {s.labels["engine"]: s.value for s in m[GAUGE].samples}


async def caches(svc: Service) -> dict[str, dict[str, Any]]:
    doc = await svc.status()
    validate_status(doc)
    return {e["engine"]: e["prefix_cache"] for e in doc["engines"]}


@pytest.mark.parametrize("refused", [0, 1, 2], ids=["first", "middle", "last"])
async def test_confirmed_refused_and_timed_out_engines_in_every_position(
    fleet_factory: ServiceFactory, refused: int
) -> None:
    fleet = await fleet_factory(3)
    timed_out = (refused + 1) % 3
    (confirmed,) = {0, 1, 2} - {refused, timed_out}
    m = await fleet.scrape()
    assert counts(m) == {"0": 0.0, "1": 0.0, "2": 0.0} and stamps(m) == {}

    fleet.engines[refused].state.refuse_reset = True
    fleet.engines[timed_out].options.hang = True  # reads the reset, never answers it
    status, body, _ = await fleet.reset()
    assert status == 502, body
    reasons = {e["engine"]: e["reason"] for e in body["engines"]}
    assert reasons == {confirmed: None, refused: "refused", timed_out: "timeout"}
    m = await fleet.scrape()
    assert counts(m) == {str(confirmed): 1.0, str(refused): 0.0, str(timed_out): 0.0}
    assert list(stamps(m)) == [str(confirmed)]
    first = stamps(m)[str(confirmed)]
    assert first <= (await fleet.status())["generated_unix"]
    by_engine = await caches(fleet)
    assert by_engine[str(confirmed)] == {
        "confirmed_resets": 1,
        "last_reset_unix": first,
        "last_reset_action": "reset_prefix_cache",
    }
    for engine in (refused, timed_out):
        assert by_engine[str(engine)] == {
            "confirmed_resets": 0,
            "last_reset_unix": None,
            "last_reset_action": None,
        }

    fleet.engines[timed_out].options.hang = False
    fleet.engines[refused].state.refuse_reset = False
    await fleet.ready()
    status, body, _ = await fleet.reset()
    assert status == 200, body
    m = await fleet.scrape()
    assert counts(m) == {str(confirmed): 2.0, str(refused): 1.0, str(timed_out): 1.0}
    assert set(stamps(m)) == {"0", "1", "2"} and stamps(m)[str(confirmed)] >= first


async def test_a_pause_and_a_sleep_reset_on_the_releases_read_and_only_when_accepted(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(
        3, per_engine={"vllm_version": {0: "0.33.0", 1: "0.32.0+cpu", 2: "0.34.0"}}
    )
    status, body = await post(fleet, "pause")
    assert status == 200, body
    m = await fleet.scrape()
    # Engine 2's vLLM is not one whose pause is known to reset the cache: not assumed.
    assert counts(m) == {"0": 1.0, "1": 1.0, "2": 0.0} and set(stamps(m)) == {"0", "1"}
    assert (await caches(fleet))["1"]["last_reset_action"] == "pause"
    assert (await post(fleet, "resume"))[0] == 200

    status, body = await post(fleet, "sleep", level="0")  # pauses only: no reset
    assert status == 200, body
    assert counts(await fleet.scrape()) == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert (await post(fleet, "wake_up"))[0] == 200

    fleet.engines[1].state.missing_methods = frozenset({"sleep"})  # its sleep fails
    status, body = await post(fleet, "sleep", level="1")
    assert status == 502, body
    m = await fleet.scrape()
    assert counts(m) == {"0": 2.0, "1": 1.0, "2": 0.0}
    by_engine = await caches(fleet)
    assert by_engine["0"]["last_reset_action"] == "sleep"
    assert by_engine["1"]["last_reset_action"] == "pause"
    assert by_engine["0"]["last_reset_unix"] > by_engine["1"]["last_reset_unix"]
    # The counter and the gauge agree with /status.
    assert stamps(m)["0"] == by_engine["0"]["last_reset_unix"]
    assert metric_value(m, COUNTER, engine="0") == by_engine["0"]["confirmed_resets"]


async def test_kv_events_targets_name_every_publishing_engine(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(
        3, options=SimOptions(kv_events=KV_EVENTS), per_engine={"kv_events": {1: None}}
    )
    async with fleet.session.get(fleet.url + "/kv_events_targets") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/json")
        targets = await resp.json()
    # vLLM offsets each rank's ports; the wildcard host is where the engine connected from.
    assert targets == [
        {
            "targets": ["127.0.0.1:5557"],
            "labels": {
                "engine": "0",
                "topic": "kv",
                "endpoint": "tcp://*:5557",
                "publisher": "zmq",
                "replay": "127.0.0.1:5600",
            },
        },
        {
            "targets": ["127.0.0.1:5559"],
            "labels": {
                "engine": "2",
                "topic": "kv",
                "endpoint": "tcp://*:5559",
                "publisher": "zmq",
                "replay": "127.0.0.1:5602",
            },
        },
    ]
    doc = await fleet.status()
    validate_status(doc)
    kv = {e["engine"]: e["kv_events"] for e in doc["engines"]}
    assert kv["1"] is None
    assert kv["2"] == {
        "publisher": "zmq",
        "endpoint": "tcp://*:5559",
        "replay_endpoint": "tcp://*:5602",
        "topic": "kv",
        "target": "127.0.0.1:5559",
        "replay_target": "127.0.0.1:5602",
        "note": None,
    }
    # An engine that went away is no target any more (its /status entry stays).
    fleet.engines[2].options.shutdown_window_s = 0.0
    fleet.engines[2].stop()

    await eventually(
        lambda: [d.connected for d in fleet.exporter.client.engine_details()] == [1, 1, 0],
        what="engine 2's disconnection",
    )
    await fleet.fresh_poll()
    _, targets = await fleet.get_json("/kv_events_targets")
    assert [group["labels"]["engine"] for group in targets] == ["0"]
    assert (await fleet.status())["engines"][2]["kv_events"]["target"] == "127.0.0.1:5559"


async def test_an_empty_list_when_no_engine_publishes(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    status, body = await fleet.get_json("/kv_events_targets")
    assert (status, body) == (200, [])
    doc = await fleet.status()
    assert [e["kv_events"] for e in doc["engines"]] == [None, None]


HOSTILE = [
    ["tcp://*:5557"],
    "tcp://*:5557",
    {**KV_EVENTS, "endpoint": "tcp://*:" + "5" * (MAX_ENDPOINT * 40)},
    {**KV_EVENTS, "endpoint": "tcp://*:5557\r\nX: y"},
    {**KV_EVENTS, "topic": "t" * 100_000},
    {**KV_EVENTS, "replay_endpoint": {"nested": ["x"] * 1000}},
    {**KV_EVENTS, "enable_kv_cache_events": 1},
]


@pytest.mark.parametrize("hostile", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
async def test_a_hostile_kv_events_config_is_refused_alone(
    fleet_factory: ServiceFactory, hostile: Any
) -> None:
    fleet = await fleet_factory(
        2,
        options=SimOptions(kv_events=KV_EVENTS),
        per_engine={"registration_extra": {0: {"kv_events_config": hostile}}},
    )
    doc = await fleet.status()
    validate_status(doc)
    first, second = doc["engines"]
    assert first["kv_events"] is None and first["vllm_version"] == "0.33.0" and first["up"]
    assert second["kv_events"]["target"] == "127.0.0.1:5558"
    _, targets = await fleet.get_json("/kv_events_targets")
    assert [t["labels"]["engine"] for t in targets] == ["1"]
    assert fleet.exporter.faults.counts.get("bad_kv_events_config") == 1
    m = await fleet.scrape()
    assert metric_value(m, "vllm_dp_protocol_errors_total", kind="bad_kv_events_config") == 1.0


async def test_an_ipv6_engines_wildcard_host_comes_in_brackets(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(
        2,
        handshake_address=f"tcp://[::1]:{free_listen_port('::1')}",
        advertise_host="::1",
        options=SimOptions(kv_events={**KV_EVENTS, "endpoint": "tcp://[::]:5557"}),
    )
    _, targets = await fleet.get_json("/kv_events_targets")
    assert [(t["targets"], t["labels"].get("replay")) for t in targets] == [
        (["[::1]:5557"], "[::1]:5600"),
        (["[::1]:5558"], "[::1]:5601"),
    ]
