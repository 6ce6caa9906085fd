"""Engines outside the expected set (a DP scale-up the exporter was not restarted for) are
refused, counted and *listed* in /status, at the first and the last position past the set,
and a stranger's many identities stay bounded (docs/fault-tolerance.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from exporter.client.enginecore.events import MAX_UNEXPECTED
from exporter.protocol import HELLO, encode_handshake_message
from exporter.sim.engine import SimEngine
from exporter.sim.options import SimOptions
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually


async def status(svc: Service) -> dict[str, Any]:
    async with svc.session.get(svc.url + "/status") as resp:
        assert resp.status == 200
        doc: dict[str, Any] = await resp.json()
    validate_status(doc)
    return doc


async def test_engines_past_the_expected_set_are_listed(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    assert (await status(fleet))["unexpected_engines"] == []
    strangers = [
        SimEngine(
            fleet.config.handshake_address,
            index,
            SimOptions(handshake_timeout_s=1.0),
            context=fleet.context,
        )
        for index in (2, 7)
    ]
    tasks = [asyncio.create_task(e.run()) for e in strangers]
    try:
        await eventually(
            lambda: fleet.exporter.faults.counts.get("unknown_identity", 0) >= 2,
            what="both handshakes refused",
        )
        doc = await status(fleet)
        listed = {e["dp_rank"]: e for e in doc["unexpected_engines"]}
        assert set(listed) == {2, 7}
        assert listed[2]["identity"] == "0200" and listed[2]["handshakes"] >= 1
        # The expected engines are untouched.
        assert [e["up"] for e in doc["engines"]] == [True, True] and doc["engines_expected"] == 2
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_stranger_with_many_identities_stays_bounded(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(2)
    ctx: zmq.asyncio.Context = fleet.context
    socks = []
    try:
        for i in range(MAX_UNEXPECTED + 36):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, b"stranger-%04d" % i)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(fleet.config.handshake_address)
            await sock.send(encode_handshake_message(HELLO))
            socks.append(sock)
        await eventually(
            lambda: fleet.exporter.faults.counts.get("unknown_identity", 0) >= MAX_UNEXPECTED + 36,
            what="every HELLO refused",
        )
        listed = (await status(fleet))["unexpected_engines"]
        assert len(listed) == MAX_UNEXPECTED
        sent = {(b"stranger-%04d" % i).hex() for i in range(MAX_UNEXPECTED + 36)}
        assert {e["identity"] for e in listed} <= sent
        # An identity that is not two bytes has no DP rank.
        assert {e["dp_rank"] for e in listed} == {None}
        # The most recent are kept. ZMQ fair-queues HELLOs from many connections in no fixed
        # order, so "most recent" is checked with one latecomer sent after the rest were counted.
        late = ctx.socket(zmq.DEALER)
        late.setsockopt(zmq.IDENTITY, b"latecomer")
        late.setsockopt(zmq.LINGER, 0)
        late.connect(fleet.config.handshake_address)
        socks.append(late)
        await late.send(encode_handshake_message(HELLO))
        await eventually(
            lambda: fleet.exporter.faults.counts.get("unknown_identity", 0) >= MAX_UNEXPECTED + 37,
            what="the latecomer refused",
        )
        listed = (await status(fleet))["unexpected_engines"]
        assert len(listed) == MAX_UNEXPECTED
        assert listed[-1]["identity"] == b"latecomer".hex()
        assert [e["up"] for e in (await status(fleet))["engines"]] == [True, True]
    finally:
        for sock in socks:
            sock.close()
