"""Relay mode's request counts: the DP coordinator's publication named in the INIT it relays,
subscribed to as one more front end (real ZMQ: simulated front end, coordinator, engines)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.base.ports import free_port_range
from exporter.client.enginecore.links import Phase
from exporter.client.relay import coordinator
from exporter.protocol.activity import MAX_COORDINATOR_MESSAGE, RequestCounts
from tests.harness.relay import MakeHarness, RelayHarness


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def _requests(harness: RelayHarness) -> dict[str, RequestCounts | None]:
    return {d.engine: d.requests for d in harness.relay.client.engine_details()}


def _known_ranks(harness: RelayHarness, count: int) -> bool:
    return sum(r is not None for r in _requests(harness).values()) == count


def _refused(harness: RelayHarness) -> int:
    return harness.relay.faults.counts.get("bad_coordinator_stats", 0)


def _refused_since(harness: RelayHarness, before: int) -> bool:
    return _refused(harness) > before


async def _relay_with_coordinator(
    make_harness: MakeHarness, publish: Callable[[], list[Any] | bytes], engines: int = 3
) -> RelayHarness:
    harness = make_harness(engines)
    await harness.start_frontend(coordinator=publish)
    await harness.start_relay()
    harness.start_engines()
    await harness.wait_handshakes()
    return harness


async def test_counts_follow_the_coordinators_publication(make_harness: MakeHarness) -> None:
    published: list[Any] = [(0, 0), (2, 5), (0, 0)]
    harness = await _relay_with_coordinator(make_harness, lambda: list(published))
    assert harness.relay.client.capabilities.request_counts
    await _until(lambda: _requests(harness)["1"] == RequestCounts(2, 5))
    assert _requests(harness) == {
        "0": RequestCounts(0, 0),
        "1": RequestCounts(2, 5),
        "2": RequestCounts(0, 0),
    }
    published[1] = (0, 0)
    published[2] = (1, 0)
    await _until(lambda: _requests(harness)["2"] == RequestCounts(1, 0))
    assert _requests(harness)["1"] == RequestCounts(0, 0)
    # The front end's own calls were never disturbed by the relay's subscription.
    assert harness.fe.ok_count() > 0


async def test_hostile_entries_at_the_first_middle_and_last_rank_are_unknown(
    make_harness: MakeHarness,
) -> None:
    hostile: list[Any] = [[-1, 0, 0.0], ["x", 1, 0.0], [0, 10**12, 0.0], [True, 1], [1]]
    for position in (0, 1, 2):
        for entry in hostile:
            published: list[Any] = [[0, 1, 0.0]] * 3
            published[position] = entry
            harness = await _relay_with_coordinator(make_harness, published.copy)
            await _until(functools.partial(_known_ranks, harness, 2))
            counts = _requests(harness)
            assert counts[str(position)] is None, (position, entry)
            assert all(counts[str(i)] == RequestCounts(1, 0) for i in range(3) if i != position)
            await harness.close()


async def test_a_garbled_or_oversized_publication_is_refused_and_the_last_counts_kept(
    make_harness: MakeHarness, monkeypatch: Any
) -> None:
    monkeypatch.setattr(coordinator, "STALE_AFTER_S", 1.0)
    good: list[Any] = [(1, 1), (0, 0), (0, 0)]
    state: dict[str, list[Any] | bytes] = {"message": good}
    harness = await _relay_with_coordinator(make_harness, lambda: state["message"])
    await _until(lambda: _requests(harness)["0"] == RequestCounts(1, 1))
    for garbled in (b"\xc1", msgspec.msgpack.encode({"counts": 1}), msgspec.msgpack.encode([1])):
        before = _refused(harness)
        state["message"] = garbled
        await _until(functools.partial(_refused_since, harness, before))
        assert _requests(harness)["0"] == RequestCounts(1, 1)  # nothing new was believed
    # Over the size bound: ZMQ drops the connection before anything is read; the relay
    # subscribes afresh once nothing came for STALE_AFTER_S.
    state["message"] = b"\x00" * (MAX_COORDINATOR_MESSAGE + 1)
    await asyncio.sleep(0.5)
    assert _requests(harness)["0"] == RequestCounts(1, 1)
    state["message"] = [(4, 0), (0, 0), (0, 0)]
    await _until(lambda: _requests(harness)["0"] == RequestCounts(4, 0))
    calls = await harness.relay.call("is_sleeping")
    assert all(o.ok for o in calls), "the relay keeps calling its engines"


async def test_without_a_coordinator_the_counts_are_unknown(make_harness: MakeHarness) -> None:
    harness = make_harness(2)
    await harness.start_frontend()
    await harness.start_relay()
    harness.start_engines()
    await harness.wait_handshakes()
    await asyncio.sleep(0.3)
    assert _requests(harness) == {"0": None, "1": None}
    assert harness.relay.transport.coordinator.address is None


async def test_counts_go_unknown_when_the_coordinator_falls_silent(
    make_harness: MakeHarness, monkeypatch: Any
) -> None:
    harness = await _relay_with_coordinator(make_harness, lambda: [(3, 0)] * 3)
    await _until(lambda: _requests(harness)["0"] == RequestCounts(3, 0))
    monkeypatch.setattr(coordinator, "STALE_AFTER_S", 0.0)
    await harness.fe.close()  # the coordinator stops publishing
    await asyncio.sleep(0.05)
    assert set(_requests(harness).values()) == {None}


async def test_a_restarted_relay_follows_the_coordinator_its_state_file_recorded(
    make_harness: MakeHarness,
) -> None:
    """Restored engines never handshake again, so no INIT names the publication: the state
    file records it, and the next relay process subscribes to it (counts, not unknown)."""
    harness = make_harness(3)
    state = harness.tmp_path / "s.json"
    opts: dict[str, Any] = {"fixed_base_port": free_port_range(4), "state_file": str(state)}
    await harness.start_frontend(coordinator=lambda: [(0, 2), (1, 0), (0, 0)])
    first = await harness.start_relay(**opts)
    harness.start_engines()
    await harness.wait_handshakes()
    await _until(lambda: _requests(harness)["0"] == RequestCounts(0, 2))
    recorded = first.transport.coordinator.address
    await _until(lambda: state.exists() and "coordinator_stats_address" in state.read_text())
    assert json.loads(state.read_text())["coordinator_stats_address"] == recorded
    await first.client.close()

    second = await harness.start_relay(**opts)
    assert second.transport.coordinator.address == recorded
    await _until(lambda: _requests(harness)["1"] == RequestCounts(1, 0))
    assert harness.fe.hello_count(0) == 1, "counts came back without a new handshake"


async def test_a_state_file_with_a_bad_coordinator_address_is_not_believed(
    make_harness: MakeHarness,
) -> None:
    harness = make_harness(2)
    state = harness.tmp_path / "s.json"
    opts = {"fixed_base_port": free_port_range(3), "state_file": str(state)}
    await harness.start_frontend(coordinator=lambda: [(0, 1), (0, 1)])
    first = await harness.start_relay(**opts)
    harness.start_engines()
    await harness.wait_handshakes()
    await _until(lambda: state.exists() and "coordinator_stats_address" in state.read_text())
    await first.client.close()
    written = json.loads(state.read_text())
    for bad in (17, "", "x" * 100_000, ["tcp://127.0.0.1:1"]):
        state.write_text(json.dumps({**written, "coordinator_stats_address": bad}))
        relay = await harness.start_relay(**opts)
        assert relay.transport.coordinator.address is None, bad  # the file as a whole ignored
        assert not any(link.phase is Phase.RESTORED for link in relay.transport._links.values())
        await relay.client.close()


async def test_an_init_naming_a_malformed_publication_is_counted_and_nothing_is_read() -> None:
    """The address comes from the front end's INIT (a peer's value): one ZMQ refuses is
    counted, the counts stay unknown, and the next good address is still followed."""
    faults = ProtocolErrorTally()
    ctx = zmq.asyncio.Context()
    counts = coordinator.CoordinatorCounts(ctx, faults, range(3))
    try:
        for bad in ("not an address", "tcp://", "tcp://127.0.0.1:" + "9" * 10_000, "udp://x:1"):
            counts.follow(bad)
            await asyncio.sleep(0.05)  # the subscription runs on the loop
            assert counts.counts() == {}, bad
        assert faults.counts.get("bad_coordinator_address", 0) >= 3
        counts.follow(None)  # no coordinator: the last address stays, nothing new
        assert counts.address == "udp://x:1"
    finally:
        await counts.close()
        ctx.term()
