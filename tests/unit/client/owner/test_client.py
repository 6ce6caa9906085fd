"""``owner_client``: the one place owner mode's client is built; what it promises the layers
above (client 0: fault-tolerance pushes, no front end beside it) over a stub context."""

from __future__ import annotations

from typing import Any, cast

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.owner.client import owner_client
from exporter.client.owner.transport import OwnerConfig, OwnerTransport


def build(**kwargs: Any) -> EngineCoreClient:
    config = OwnerConfig(engine_count=3, start_rank=2, handshake_address="tcp://127.0.0.1:1")
    return owner_client(config, ProtocolErrorTally(), context=cast(Any, object()), **kwargs)


def test_the_client_owns_an_owner_transport_listening_to_it() -> None:
    client = build()
    transport = client.transport
    assert isinstance(transport, OwnerTransport)
    assert transport._listener is client
    assert transport.config.handshake_address == "tcp://127.0.0.1:1"
    assert client.engine_labels == ["2", "3", "4"]


def test_owner_mode_is_client_zero_and_reads_pushed_fault_status() -> None:
    capabilities = build().capabilities
    assert capabilities.fault_status
    assert not capabilities.beside_a_front_end
    assert not capabilities.request_counts
    assert capabilities.handshakes


def test_allowed_methods_and_callbacks_reach_the_client() -> None:
    changes: list[str] = []
    client = build(
        allowed_methods=frozenset({"is_sleeping"}),
        on_change=lambda: changes.append("change"),
        on_status=lambda: changes.append("status"),
    )
    assert client.capabilities.methods == frozenset({"is_sleeping"})
    client.on_engine_up(2, handshaken=True)
    client.on_engine_down(2, "dead")
    assert changes == ["change", "change"]
    assert client._on_status is not None
    client._on_status()
    assert changes[-1] == "status"


def test_the_transport_shares_the_callers_context() -> None:
    """ctl probe and the simulated front end pass their own context: no second one is made."""
    context = cast(Any, object())
    config = OwnerConfig(engine_count=1, handshake_address="tcp://127.0.0.1:1")
    client = owner_client(config, ProtocolErrorTally(), context=context)
    transport = client.transport
    assert isinstance(transport, OwnerTransport)
    assert transport._ctx is context
    assert not transport._own_context
