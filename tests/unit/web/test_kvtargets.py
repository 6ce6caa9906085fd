"""The ``http_sd`` document of the engines' KV-events publishers from a hand-built snapshot:
one target group per connected engine a consumer can reach, in engine order, its labels, and
nothing for engines that publish nothing, cannot be reached or are gone."""

from __future__ import annotations

from exporter.client.fleet import EngineDetail
from exporter.fleetstate.snapshot import EngineSnapshot
from exporter.protocol.kv_events import KvEventsSource
from exporter.web.kvtargets import kv_events_targets
from tests.harness.snapshots import engine_snapshot, polled


def source(target: str | None, replay: str | None = None, topic: str = "") -> KvEventsSource:
    return KvEventsSource(
        publisher="zmq",
        endpoint="tcp://*:5557",
        replay_endpoint="tcp://*:5600" if replay else None,
        topic=topic,
        target=target,
        replay_target=replay,
        note=None if target else "ipc endpoint: not reachable from another host",
    )


def engine(name: str, kv: KvEventsSource | None, connected: bool = True) -> EngineSnapshot:
    return engine_snapshot(name, EngineDetail(name, connected, f"fake://{name}", kv_events=kv))


def test_one_group_per_reachable_publisher_in_engine_order() -> None:
    snap = polled(
        engine("0", source("10.0.0.5:5557", replay="10.0.0.5:5600", topic="kv")),
        engine("1", None),
        engine("2", source(None)),
        engine("3", source("10.0.0.8:5557"), connected=False),
        engine("4", source("[::1]:5557")),
    )
    assert kv_events_targets(snap) == [
        {
            "targets": ["10.0.0.5:5557"],
            "labels": {
                "engine": "0",
                "topic": "kv",
                "endpoint": "tcp://*:5557",
                "publisher": "zmq",
                "replay": "10.0.0.5:5600",
            },
        },
        {
            "targets": ["[::1]:5557"],
            "labels": {"engine": "4", "topic": "", "endpoint": "tcp://*:5557", "publisher": "zmq"},
        },
    ]


def test_the_model_name_labels_every_group_when_set() -> None:
    snap = polled(engine("0", source("h:1")), engine("1", source("h:2")))
    named = kv_events_targets(snap, "llama")
    assert [group["labels"]["model_name"] for group in named] == ["llama", "llama"]
    for unnamed in (None, ""):
        assert all("model_name" not in g["labels"] for g in kv_events_targets(snap, unnamed))


def test_no_publisher_is_an_empty_list_not_an_error() -> None:
    assert kv_events_targets(polled(engine("0", None), engine("1", source(None)))) == []
    assert kv_events_targets(polled()) == []
