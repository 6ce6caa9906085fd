"""``relay_client``: relay mode's client beside a stock front end, which owns the engines and
receives their pushes; the exporter reads request counts from the DP coordinator instead."""

from __future__ import annotations

import msgspec

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.relay.client import relay_client
from exporter.client.relay.transport import RelayConfig, RelayTransport
from exporter.protocol.activity import RequestCounts


def build(changes: list[int] | None = None) -> EngineCoreClient:
    config = RelayConfig(
        engine_count=2,
        start_rank=6,
        handshake_address="tcp://127.0.0.1:1",
        upstream_handshake_address="tcp://127.0.0.1:2",
    )
    on_change = None if changes is None else (lambda: changes.append(1))
    return relay_client(config, ProtocolErrorTally(), on_change=on_change)


async def test_the_client_owns_a_relay_transport_listening_to_it() -> None:
    client = build()
    transport = client.transport
    assert isinstance(transport, RelayTransport)
    assert transport._listener is client
    assert transport.config.upstream_handshake_address == "tcp://127.0.0.1:2"
    assert client.engine_labels == ["6", "7"]
    await transport.close()  # terminates the context it made (nothing was opened)


async def test_beside_a_front_end_there_are_no_pushes_but_request_counts() -> None:
    client = build()
    capabilities = client.capabilities
    assert capabilities.beside_a_front_end and capabilities.request_counts
    assert not capabilities.fault_status
    await client.transport.close()


async def test_request_counts_reach_the_engine_details_from_the_coordinator() -> None:
    client = build()
    transport = client.transport
    assert isinstance(transport, RelayTransport)
    ranks: list[list[int] | None] = [None] * 6 + [[3, 2], [0, 0]]  # [waiting, running] by rank
    transport.coordinator._take(msgspec.msgpack.encode([ranks, 0, False]))
    requests = {d.engine: d.requests for d in client.engine_details()}
    assert requests == {"6": RequestCounts(running=2, waiting=3), "7": RequestCounts(0, 0)}
    await transport.close()


async def test_a_change_of_engine_reaches_the_callback() -> None:
    changes: list[int] = []
    client = build(changes)
    client.on_engine_up(6, handshaken=True)
    client.on_engine_down(6, "restarted")
    assert changes == [1, 1]
    await client.transport.close()
