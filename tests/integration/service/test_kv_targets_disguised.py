"""``GET /kv_events_targets`` judges an address, not its spelling.

An engine's registration names its KV-events publisher; the exporter lists the ``host:port`` a
consumer connects to only when it is the engine's own address or a wildcard. An IPv4 address
written as IPv6 (mapped, in dotted or hex form, upper case, zero-padded, translated, compatible,
NAT64) is that IPv4 address: listed exactly when its plain IPv4 spelling is. Real ZMQ (simulated
engines on loopback) and real HTTP; the exporter only lists these addresses, and a guard checks
that nothing in the test connects a ZMQ socket anywhere but loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from exporter.sim.options import SimOptions
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status

#: The engines' own address: they connect from loopback.
ENGINE_HOST = "127.0.0.1"
PUBLISHER = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
#: Every spelling of a third host's address, 10.9.9.9: none may be listed.
THIRD_HOST = [
    "10.9.9.9",
    "[::ffff:10.9.9.9]",
    "[::ffff:a09:909]",
    "[::FFFF:0A09:0909]",
    "[0:0:0:0:0:ffff:a09:909]",
    "[0000:0000:0000:0000:0000:ffff:0a09:0909]",
    "[::ffff:0:10.9.9.9]",
    "[::ffff:0:a09:909]",
    "[::10.9.9.9]",
    "[64:ff9b::a09:909]",
    "[::ffff:10.9.9.9%lo]",
    "[::ffff:010.9.9.9]",
    "0x0a.9.9.9",
    "010.9.9.9",
    "10.9.2313",
    "167315721",
]
#: The engine's own address or the wildcard, however spelt: listed as the engine's address.
OWN_HOST = [
    "[::ffff:127.0.0.1]",
    "[::ffff:7f00:1]",
    "[::FFFF:7F00:0001]",
    "[::ffff:0.0.0.0]",
    "[::0]",
    "*",
]


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every ZMQ connect during the test, refused unless to loopback."""
    seen: list[str] = []
    connect = zmq.Socket.connect

    def guarded(self: zmq.Socket[Any], addr: str) -> Any:
        seen.append(addr)
        assert addr.startswith(("tcp://127.0.0.1:", "tcp://[::1]:", "ipc://", "inproc://")), addr
        return connect(self, addr)

    monkeypatch.setattr(zmq.Socket, "connect", guarded)
    yield seen


async def fleet_with(factory: ServiceFactory, endpoint: str, replay: str | None = None) -> Service:
    """Two engines: engine 0 registers ``endpoint`` (and ``replay``), engine 1 a wildcard."""
    first = {**PUBLISHER, "endpoint": endpoint, "replay_endpoint": replay}
    return await factory(
        2,
        options=SimOptions(kv_events={**PUBLISHER, "endpoint": "tcp://*:5557"}),
        per_engine={"registration_extra": {0: {"kv_events_config": first}}},
    )


async def listed(svc: Service) -> list[tuple[str, list[str], str | None]]:
    status, groups = await svc.get_json("/kv_events_targets")
    assert status == 200
    return [(g["labels"]["engine"], g["targets"], g["labels"].get("replay")) for g in groups]


@pytest.mark.parametrize("host", THIRD_HOST)
async def test_no_spelling_of_a_third_hosts_address_is_listed(
    fleet_factory: ServiceFactory, host: str, loopback_only: list[str]
) -> None:
    fleet = await fleet_with(fleet_factory, f"tcp://{host}:5557")
    assert await listed(fleet) == [("1", [f"{ENGINE_HOST}:5558"], None)]
    doc = await fleet.status()
    validate_status(doc)
    refused = doc["engines"][0]["kv_events"]
    assert refused["endpoint"] == f"tcp://{host}:5557"
    assert refused["target"] is None and refused["note"]
    assert loopback_only  # the engines did connect, to loopback only


@pytest.mark.parametrize("host", OWN_HOST)
async def test_the_engines_own_address_is_listed_however_spelt(
    fleet_factory: ServiceFactory, host: str
) -> None:
    fleet = await fleet_with(fleet_factory, f"tcp://{host}:5557", f"tcp://{host}:5600")
    assert await listed(fleet) == [
        ("0", [f"{ENGINE_HOST}:5557"], f"{ENGINE_HOST}:5600"),
        ("1", [f"{ENGINE_HOST}:5558"], None),
    ]


async def test_a_disguised_replay_endpoint_is_not_listed(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_with(fleet_factory, "tcp://*:5557", "tcp://[::ffff:a09:909]:5600")
    assert await listed(fleet) == [
        ("0", [f"{ENGINE_HOST}:5557"], None),
        ("1", [f"{ENGINE_HOST}:5558"], None),
    ]
    doc = await fleet.status()
    source = doc["engines"][0]["kv_events"]
    assert source["replay_target"] is None and source["note"].startswith("replay: ")
