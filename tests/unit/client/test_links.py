"""Which connection to an engine's output address is the engine's own: the pure decisions behind
believing an ENGINE_CORE_DEAD at once and marking an engine lost (no sockets here; the same
rules over real sockets: tests/integration/resilience)."""

from __future__ import annotations

from exporter.client.enginecore.links import (
    EngineLink,
    engine_connection_closed,
    is_engine_connection,
)


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
