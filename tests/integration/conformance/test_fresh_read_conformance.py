"""A fresh read (every read but the poller's: the gate's above all) is answered only by requests
sent after it was asked, in every attach mode. A rank answers late: its late answer to one call
(owner, relay, in-process: the reply to a call id no longer waited for; a plugin-enabled server:
its whole gate answer, which comes after the sidecar's deadline) says the rank is idle; then the
rank and its neighbour get work. No later read says either of them is idle: each is a timeout or
its fresh ``has_work``. The work comes only once the late answer is known to have been sent
(rank 0's side answered every request it read: ``FleetKind.answered``, a count, never a sleep).
Every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import pytest

from exporter.client.fleet import EngineOutcome
from tests.harness.fleet_kinds import FleetKind
from tests.harness.waiting import eventually

pytestmark = pytest.mark.timeout(90)

#: The reads' deadline, and how late rank 0 answers: after that deadline and, behind a
#: plugin-enabled server, after the server's own call timeout (0.3 s), so that the server's
#: answer comes after 0.9 of the sidecar's deadline and before two of them.
CALL_TIMEOUT_S = 0.25
LATE_S = 0.4
#: Requests that outlive the test.
LONG_S = 600.0
WAIT_S = 15.0
#: How long rank 0's side may take to send its late answer (it is due ``LATE_S`` after it read
#: the request): generous, on a shared 2-core machine.
ANSWER_WAIT_S = 10.0


async def has_work(kind: FleetKind, timeout_s: float = CALL_TIMEOUT_S) -> list[EngineOutcome]:
    return await kind.client.call_utility("has_work", timeout_s=timeout_s)


def idle(outcomes: list[EngineOutcome]) -> list[str]:
    """The engines among the first two that answered ``has_work`` false."""
    return [o.engine for o in outcomes[:2] if o.ok and o.value is False]


async def test_a_late_answer_never_answers_a_later_fresh_read(fleet_kind: FleetKind) -> None:
    kind = fleet_kind
    await kind.slow(0, LATE_S)
    asked = kind.asked(0)
    await has_work(kind)  # rank 0 (or its server) answers after this read's deadline
    # Its late answer, computed while every rank was idle, is sent back before the work comes:
    # the read's request reached rank 0's side, which then answered every request it read.
    await eventually(lambda: kind.asked(0) > asked, ANSWER_WAIT_S, "rank 0's side asked")
    await kind.all_answered(0, ANSWER_WAIT_S)
    now = time.monotonic()
    for rank in (0, 1):
        kind.work_state(rank).submit(LONG_S, now)
    for attempt in range(3):
        found = await has_work(kind)
        assert idle(found) == [], (kind.name, attempt, found)
    # Answers in time again (once rank 0 worked off the calls it holds): both ranks read as
    # busy, a read that answers, not one that fails.
    await kind.slow(0, 0.0)
    deadline = time.monotonic() + WAIT_S
    while True:
        found = await has_work(kind, timeout_s=1.0)
        if [o.value for o in found[:2]] == [True, True]:
            break
        assert time.monotonic() < deadline, f"{kind.name}: ranks 0, 1 never read busy: {found}"
        await asyncio.sleep(0.1)
