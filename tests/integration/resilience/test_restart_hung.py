"""A rank wedged across an exporter restart still reads hung, not disconnected.

As an operator restarts the exporter (the same fixed ports, the same state file) while one rank
is wedged with its sockets alive: the engines reconnect at the ZMQ level without a handshake,
the wedged rank's calls reach it and time out. Its connection is there (the socket monitor saw
it accepted on that rank's output address), so it is connected, and past ``--hung-after`` it is
``hung``, never ``disconnected``; it is not up and not routable before it answers (fail closed),
and the others are up. Owner and relay mode, the wedged rank first, middle or last; real ZMQ on
127.0.0.1 (``tests/harness/restart.py``); every wait is bounded.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from tests.harness.restart import RestartRig
from tests.harness.scrape import metric_value
from tests.harness.service import Service
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(60)

POSITIONS = {"first": 0, "middle": 1, "last": 2}
HUNG_AFTER_S = 0.8


@pytest.fixture
async def make_rig(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[Callable[[str], RestartRig]]:
    rigs: list[RestartRig] = []

    def make(mode: str) -> RestartRig:
        rigs.append(RestartRig(mode, tmp_path_factory.mktemp(mode)))
        return rigs[-1]

    yield make
    for rig in rigs:
        await rig.close()


def state_of(svc: Service, index: int) -> str:
    return svc.exporter.poller.snapshot.engines[index].state


async def restart_with_a_wedged_rank(rig: RestartRig, position: int) -> Service:
    """Handshake every engine with a first exporter, wedge one (it reads requests and never
    answers, its sockets alive), restart the exporter on the same ports and state file."""
    await rig.first_run()
    assert len(rig.recorded()["engines"]) == 3
    rig.engines[position].options.hang = True
    service = await rig.start(hung_after=HUNG_AFTER_S, poll_jitter=0.0)
    try:
        await eventually(lambda: state_of(service, position) == "hung", 10, "a hung rank")
    except AssertionError:
        mine = (await service.status())["engines"][position]
        seen = {k: mine[k] for k in ("state", "connected", "unresponsive_seconds", "routable")}
        pytest.fail(f"the wedged rank is not hung: {seen}")
    return service


@pytest.mark.parametrize("mode", ["owner", "relay"])
@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_wedged_across_a_restart_reads_hung_not_disconnected(
    make_rig: Callable[[str], RestartRig], mode: str, position: int
) -> None:
    rig = make_rig(mode)
    service = await restart_with_a_wedged_rank(rig, position)
    me = str(position)
    doc = await service.status()
    validate_status(doc)
    mine = doc["engines"][position]
    assert (mine["state"], mine["connected"], mine["up"]) == ("hung", True, False)
    assert mine["unresponsive_seconds"] >= HUNG_AFTER_S
    reasons = mine["routable"]["reasons"]
    assert not mine["routable"]["routable"] and "disconnected" not in reasons, reasons
    assert any(r.startswith("hung: no answer for") for r in reasons), reasons
    assert mine["handshakes"] == 0, "reattached, not handshaken again"
    others = [e for e in doc["engines"] if e["engine"] != me]
    assert all(e["state"] == "awake" and e["up"] and e["connected"] for e in others), others
    assert not doc["ready"], "a rank that never answered keeps the fleet not ready"

    m = await service.scrape()
    assert metric_value(m, "vllm_dp_engine_state", engine=me, state="hung") == 1.0
    assert metric_value(m, "vllm_dp_engine_up", engine=me) == 0.0
    unresponsive = metric_value(m, "vllm_dp_engine_unresponsive_seconds", engine=me)
    assert unresponsive is not None and unresponsive >= HUNG_AFTER_S
    for other in others:
        assert metric_value(m, "vllm_dp_engine_up", engine=other["engine"]) == 1.0
    code, body = await service.get_json(f"/readyz?engine={me}")
    assert code == 503 and "disconnected" not in body["reasons"], body

    rig.engines[position].options.hang = False  # it answers again: awake, with no handshake
    await eventually(lambda: state_of(service, position) == "awake", 10, "the rank answers")
    assert service.client.engine_details()[position].handshakes == 0
    assert rig.indices_received() <= rig.slots, rig.indices_received()


@pytest.mark.parametrize("mode", ["owner", "relay"])
async def test_a_restored_rank_whose_connection_is_gone_reads_disconnected(
    make_rig: Callable[[str], RestartRig], mode: str
) -> None:
    """The other half: a rank the state file names but whose connection is not there (its
    process gone while the exporter was down) is disconnected, never hung."""
    rig = make_rig(mode)
    await rig.first_run()
    gone = rig.engines[2]
    gone.stop()
    await eventually(lambda: rig.tasks[2].done(), 5, "the last engine exited")
    service = await rig.start(hung_after=HUNG_AFTER_S, poll_jitter=0.0)
    await eventually(
        lambda: [e.up for e in service.exporter.poller.snapshot.engines] == [True, True, False],
        10,
        "the live ranks answer",
    )
    await service.next_polls(2 + int(HUNG_AFTER_S / service.config.poll_interval))
    mine = (await service.status())["engines"][2]
    assert (mine["state"], mine["connected"], mine["unresponsive_seconds"]) == ("unknown", False, 0)
    assert "disconnected" in mine["routable"]["reasons"]
