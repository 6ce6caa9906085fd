"""Which connection to an engine's output address is the engine's own: the pure decisions behind
believing an ENGINE_CORE_DEAD at once and marking an engine lost (no sockets here; the same
rules over real sockets: tests/integration/resilience)."""

from __future__ import annotations

from exporter.client.enginecore.links import (
    EngineLink,
    FleetShape,
    Phase,
    engine_connection_closed,
    is_engine_connection,
)
from exporter.client.enginecore.linkstate import LinkTable


def link(peers: set[int], engine_fd: int | None = None) -> EngineLink:
    out = EngineLink(3, b"\x03\x00")
    out.live_peers = set(peers)
    out.engine_fd = engine_fd
    return out


def test_sentinel_believed_only_from_the_engines_own_connection() -> None:
    # Known connection: only it counts, whatever else is connected.
    assert is_engine_connection(link({10, 11}, engine_fd=10), 10)
    assert not is_engine_connection(link({10, 11}, engine_fd=10), 11)
    # Before any answer: only when it is the one connection there is.
    assert is_engine_connection(link({10}), 10)
    assert not is_engine_connection(link({10, 11}), 10)
    assert not is_engine_connection(link(set()), 10)  # not even accepted yet
    # An unknown source (ZMQ_SRCFD unavailable) is never the engine's.
    assert not is_engine_connection(link({10}), -1)
    assert not is_engine_connection(link({10}, engine_fd=10), -1)


def test_engine_gone_only_when_its_connection_or_the_last_one_closed() -> None:
    # peers are what is left after the close.
    assert engine_connection_closed(link({11}, engine_fd=10), 10)  # its own closed
    assert not engine_connection_closed(link({10}, engine_fd=10), 11)  # a stranger left
    assert engine_connection_closed(link(set()), 10)  # unknown: the last one closed
    assert not engine_connection_closed(link({11}), 10)  # unknown: another remains


def test_a_restored_engine_is_connected_exactly_while_its_connection_is_there() -> None:
    """The socket monitor decides: a restored engine (reattached without a handshake) whose
    output connection was accepted is connected, so silence reads hung, not disconnected; one
    without is not. Only UP and RESTORED with a slot count (a restored engine is callable but
    not up before it answers: ``connected`` is all that changes)."""
    table = LinkTable(FleetShape(engine_count=4))
    links = [table._links[i] for i in range(4)]
    for one in links:
        one.slot, one.phase = 0, Phase.RESTORED
    links[1].live_peers = {12}
    links[2].live_peers = {13}
    links[2].slot = None  # no slot the exporter could call it on
    links[3].phase = Phase.LOST  # its connection closed: a stale fd never counts
    links[3].live_peers = {14}
    assert [s.connected for s in table.link_snapshots()] == [False, True, False, False]
    assert table.connected_count() == 1
    links[1].live_peers.clear()  # the monitor saw it close
    assert table.connected_count() == 0
    links[0].phase = Phase.UP  # handshaken: connected as before
    assert [s.connected for s in table.link_snapshots()] == [True, False, False, False]
