"""A gate read over a plugin-enabled server is fresh: it never answers from the server's last
answer, which the poll may use when it came late. A server whose ``/dp/gate`` answer takes longer
than 0.9 of the sidecar's call timeout (one slow rank behind it is enough) first answers drained;
then a rank gets work: ``GET /gate?drained=true`` is 412, a timeout of the target's engines, on
every attempt, each attempt a request of its own, never 200 from the drained answer. Real sockets
both ways: a gate server on 127.0.0.1 (``tests/harness/hostile_api.py``) and the sidecar served
over HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from exporter.client.http.plugin_read import PLUGIN_SHARE_S
from tests.harness.apiservers import http_config
from tests.harness.hostile_api import HostileApi, gate_doc
from tests.harness.service import Service, start_service
from tests.harness.waiting import WAIT_S, eventually

GATE = "/dp/gate"
#: The sidecar's call timeout, and a server slower than 0.9 of it but within two of it: its
#: answer comes after the gate gave up and before the next gate gives up.
CALL_TIMEOUT_S = 0.5
LATE_S = 0.7


def work_doc(busy: bool) -> dict[str, Any]:
    """A plugin's gate answer: ranks 0 and 1 awake, rank 1 with work when ``busy``."""
    doc = gate_doc([0, 1])
    for entry in doc["engines"]:
        has_work = busy and entry["engine"] == "1"
        entry["values"] = {**entry["values"], "has_work": has_work}
        entry["requests"] = {"running": 2 if has_work else 0, "waiting": 0}
    return doc


class SlowGate:
    """``/dp/gate`` answering after ``delay_s`` what the ranks were when it was asked (the
    server's own fan-out reads them then), counting the answers it finished."""

    def __init__(self) -> None:
        self.busy = False
        self.delay_s = 0.0
        self.asked = 0
        self.answered = 0

    async def __call__(self, _: web.Request) -> web.StreamResponse:
        self.asked += 1
        doc = work_doc(self.busy)
        await asyncio.sleep(self.delay_s)
        self.answered += 1
        return web.json_response(doc)

    async def settled(self) -> None:
        """Every request asked so far has its answer (bounded)."""
        await eventually(lambda: self.answered == self.asked, WAIT_S, "the server's answers")


async def drained_gate(run: Service) -> tuple[int, dict[str, Any]]:
    """One ``GET /gate?drained=true`` (bounded), past the sharing window of the last one."""
    await asyncio.sleep(2 * PLUGIN_SHARE_S)
    status, body = await asyncio.wait_for(run.get_json("/gate?drained=true"), WAIT_S)
    return status, body


async def test_a_gate_never_answers_from_the_servers_late_drained_answer() -> None:
    api = await HostileApi().start()
    server = SlowGate()
    api.routes[GATE] = server
    run: Service | None = None
    try:
        config = http_config([f"t={api.url}/dp"], call_timeout=CALL_TIMEOUT_S, gate_min_interval=0)
        run = await start_service(config)
        # Answers in time: the gate reads them (and the server's ranks become engines).
        status, body = await drained_gate(run)
        assert status == 200 and [e["engine"] for e in body["engines"]] == ["t/0", "t/1"], body
        server.delay_s = LATE_S
        for attempt in range(3):
            server.busy = False
            await drained_gate(run)  # the server answers drained, after the gate's deadline
            await server.settled()
            server.busy = True  # rank 1 gets work
            asked = server.asked
            status, body = await drained_gate(run)
            assert server.asked == asked + 1, attempt  # a request of its own, every attempt
            assert status == 412 and not body["ok"], (attempt, body)
            failures = {e["engine"]: e["failures"] for e in body["engines"]}
            assert all(any("timeout" in f for f in fs) for fs in failures.values()), failures
            await server.settled()
        # In time again: the gate reads the server's answers, busy then drained.
        server.delay_s = 0.0
        status, body = await drained_gate(run)
        assert (status, body["failing_engines"]) == (412, ["t/1"]), body
        server.busy = False
        assert (await drained_gate(run))[0] == 200
    finally:
        if run is not None:
            await run.stop()
        await api.close()
