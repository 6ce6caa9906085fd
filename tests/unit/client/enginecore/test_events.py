"""``UnexpectedEngines``: strangers that tried to handshake are listed for /status, bounded so a
hostile peer cannot grow the exporter's memory."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from exporter.client.enginecore.events import MAX_UNEXPECTED, LinkSnapshot, UnexpectedEngines


def clock(start: float = 1000.0) -> UnexpectedEngines:
    ticks = itertools.count(start)
    return UnexpectedEngines(wall_clock=lambda: float(next(ticks)))


def test_a_two_byte_identity_names_its_dp_rank() -> None:
    seen = clock()
    seen.record((9).to_bytes(2, "little"))
    entry = seen.seen["0900"]
    assert (entry.dp_rank, entry.handshakes, entry.last_seen_unix) == (9, 1, 1000.0)


def test_another_identity_is_listed_without_a_rank() -> None:
    seen = clock()
    seen.record(b"stranger")
    assert seen.seen[b"stranger".hex()].dp_rank is None


def test_repeated_handshakes_are_counted_and_move_the_identity_to_the_end() -> None:
    """Newest last: the bound drops the identity seen longest ago, not a busy one."""
    seen = clock()
    seen.record(b"\x01\x00")
    seen.record(b"\x02\x00")
    seen.record(b"\x01\x00")
    assert list(seen.seen) == ["0200", "0100"]
    assert seen.seen["0100"].handshakes == 2
    assert seen.seen["0100"].last_seen_unix == 1002.0


def test_at_most_max_unexpected_identities_are_kept_the_most_recent() -> None:
    seen = clock()
    for n in range(MAX_UNEXPECTED + 5):
        seen.record(n.to_bytes(4, "little"))
    assert len(seen.seen) == MAX_UNEXPECTED
    assert (0).to_bytes(4, "little").hex() not in seen.seen
    assert next(reversed(seen.seen)) == (MAX_UNEXPECTED + 4).to_bytes(4, "little").hex()


def test_a_long_identity_is_keyed_by_its_first_32_bytes() -> None:
    """The key ends up in /status: a peer choosing a 255-byte identity does not bloat it."""
    seen = clock()
    seen.record(b"x" * 200)
    seen.record(b"x" * 32 + b"different tail")
    (key,) = seen.seen
    assert key == (b"x" * 32).hex()
    assert seen.seen[key].handshakes == 2


def test_a_link_snapshot_is_read_only() -> None:
    snap = LinkSnapshot(0, True, False, 1, None, "tcp://127.0.0.1:1")
    assert snap.refused is None and snap.fault_status is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.connected = False  # type: ignore[misc]
