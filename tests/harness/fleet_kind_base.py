"""The conformance harness's kind of fleet: what every attach mode offers a conformance test
(``FleetKind``), the fleet's size and the reasons a kind may skip a check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fleet import (
    Capabilities,
    FleetClient,
)
from exporter.sim.options import SimReply
from exporter.sim.state import EngineState
from tests.harness.service import RecordingSimEngine
from tests.harness.waiting import eventually

ENGINES = 3
WAIT_S = 10.0
#: The plugin's own call timeout: its gate answers a hung engine within it, well inside the
#: deadlines the suite gives the sidecar's calls.
PLUGIN_CALL_TIMEOUT = "0.3"
#: Paths a server answers that are not a utility call (the version and fault-status reads
#: HTTP mode makes beside its calls).
SIDE_PATHS = ("/version", "/fault_tolerance/status", "/v1/fault_tolerance/status")
KINDS = ("fake", "owner", "relay", "http", "http_plugin", "inprocess")
#: Promises a kind may break today (``FleetKind.known_gaps``).
ENGINE_STRINGS = "engine strings are cut where a reply is decoded"
EVERY_READ_METHOD = "every read method is answered"
#: What the fake's engines answer by default (a fresh simulated engine's answers).
DEFAULT_ANSWERS: dict[str, Any] = {
    "is_sleeping": False,
    "is_scheduler_paused": False,
    "get_weight_version": None,
    "has_work": False,
    "is_inference_ready": True,
    "checkpoint_state": ["running", None],  # vLLM 0.34's
    "reset_prefix_cache": True,
}


def engine_fault(engine: RecordingSimEngine, reply: SimReply) -> None:
    """Engine answers every request with ``reply`` from now on (recorded first)."""
    engine._then = lambda _c, _i, _m, _a: reply


def has_work_fault(engine: RecordingSimEngine, reply: SimReply) -> None:
    """Engine answers ``has_work`` with ``reply`` from now on; everything else as before."""
    engine._then = lambda _c, _i, method, _a: reply if method == "has_work" else None


def _finish(state: EngineState) -> None:
    """Every request of ``state`` is done (their clients got their answers)."""
    state.work.running.clear()
    state.work.waiting.clear()


@dataclass
class FleetKind:
    """A started client of one kind over ``ENGINES`` engines, and what a test may do to them.

    What the mode documents, as data: ``capabilities`` and ``counter_families`` (its own
    series), ``death_takes_all`` (vLLM's front end fails as a whole when one engine dies:
    in-process mode and a plugin-enabled server), ``flags_shutting_down`` (a "Server shutting
    down" failure is marked ``shutting_down``). ``known_gaps``: promise → why this kind breaks
    it today (a product bug the suite reports; those tests are strict xfails for this kind)."""

    name: str
    client: FleetClient
    capabilities: Capabilities
    counter_families: frozenset[str] = frozenset()
    death_takes_all: bool = False
    flags_shutting_down: bool = True
    #: A failure's text is the outcome's error as the engine sent it (HTTP mode: inside the
    #: server's or the gate's own wording).
    failure_text_as_sent: bool = True
    known_gaps: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    _cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return self.client.engine_labels

    # -- faults of engine i (overridden per kind) -------------------------------------------

    async def hang(self, i: int) -> None:
        """Engine ``i`` reads requests and never answers."""
        raise NotImplementedError

    async def recover(self, i: int) -> None:
        """Engine ``i``, hung, answers again (the calls it read meanwhile stay unanswered)."""
        raise NotImplementedError

    async def freeze(self, i: int) -> None:
        """Engine ``i`` stops as a process stopped with SIGSTOP: nothing it is sent is read."""
        await self.hang(i)

    async def thaw(self, i: int) -> None:
        """Engine ``i`` runs again (SIGCONT) and answers what waited, in order."""
        await self.recover(i)

    async def fail(self, i: int, text: str) -> None:
        """Engine ``i`` answers every call with the failure ``text``."""
        raise NotImplementedError

    async def slow(self, i: int, delay_s: float) -> None:
        """Engine ``i`` answers each call ``delay_s`` after it reads it, one call at a time
        (0: at once again)."""
        raise NotImplementedError

    async def shut_down(self, i: int) -> None:
        """Engine ``i`` is between SIGTERM and exit: its calls fail "Server shutting down"."""
        raise NotImplementedError

    async def disconnect(self, i: int) -> None:
        """Engine ``i`` is gone; returns once the client can know it (bounded)."""
        raise NotImplementedError

    async def answer_long(self, i: int, text: str) -> None:
        """Engine ``i`` answers ``get_weight_version`` with ``text``."""
        raise NotImplementedError

    async def lack(self, i: int, method: str) -> None:
        """Engine ``i`` has no ``method`` (an older vLLM)."""
        raise NotImplementedError

    # -- the work of engine i --------------------------------------------------------------

    def work_state(self, i: int) -> EngineState:
        """Engine ``i``'s simulated state, its requests included (``EngineState.work``)."""
        raise NotImplementedError

    async def _fresh(self) -> None:
        """Wait until the client's next call asks the engines again (only where answers are
        shared for a while: a plugin-enabled server)."""

    async def give_work(self, i: int, duration_s: float, count: int = 1) -> None:
        """``count`` requests of ``duration_s`` seconds arrive at engine ``i`` (queued while its
        scheduler is paused; its ``has_work`` is true until they are done)."""
        self.work_state(i).submit(duration_s, time.monotonic(), count)
        await self._fresh()

    async def finish_work(self, i: int) -> None:
        """Engine ``i``'s requests are all done."""
        _finish(self.work_state(i))
        await self._fresh()

    def counts(self, i: int) -> tuple[int, int]:
        """Engine ``i``'s (running, waiting) requests now."""
        return self.work_state(i).request_counts(time.monotonic())

    def paused(self, i: int) -> bool:
        """Whether engine ``i``'s scheduler is paused."""
        return self.work_state(i).paused

    async def answer_has_work(self, i: int, value: Any) -> None:
        """Engine ``i`` answers ``has_work`` with ``value`` (a hostile one: not a boolean)."""
        raise NotImplementedError

    async def fail_has_work(self, i: int, text: str) -> None:
        """Engine ``i``'s ``has_work`` fails with ``text``; its other calls are answered."""
        raise NotImplementedError

    # -- what reached the engines -----------------------------------------------------------

    def requests(self) -> int:
        """Utility requests from this client that reached the far side so far."""
        raise NotImplementedError

    def sent_to(self, i: int) -> int:
        """Utility requests from this client that engine ``i`` read so far."""
        raise NotImplementedError

    def asked(self, i: int) -> int:
        """Requests from this client that reached engine ``i``'s side (its own reads, or its
        server's): what a test waits on before acting on a call in flight."""
        return self.sent_to(i)

    def answered(self, i: int) -> int:
        """Answers engine ``i``'s side sent back so far (its replies, or its server's answers),
        counted as ``asked`` counts requests: once it reaches ``asked(i)``, every request that
        side had read has been answered, a late one included: what a test waits on before it
        relies on a late answer having come (a count, not a sleep)."""
        raise NotImplementedError

    async def all_answered(self, i: int, timeout_s: float = WAIT_S) -> None:
        """Wait (bounded) until engine ``i``'s side has answered every request it read by now."""
        asked = self.asked(i)
        what = f"{self.name}: engine {i}'s side answering its {asked} requests"
        await eventually(lambda: self.answered(i) >= asked, timeout_s, what)

    def pending(self) -> int:
        """Calls this client still has in flight (bookkeeping a closed client must not keep)."""
        raise NotImplementedError

    # -- life cycle -------------------------------------------------------------------------

    async def close_client(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.close()

    async def stop(self) -> None:
        """The client, then whatever it was attached to (every step bounded)."""
        await asyncio.wait_for(self.close_client(), WAIT_S)
        for cleanup in reversed(self._cleanups):
            await asyncio.wait_for(cleanup(), 15)


# -- the fake ----------------------------------------------------------------------------------
