"""One fan-out's calls through vLLM's client, waited for under one deadline, and read back.

A fan-out to 256 engines resolves 256 of vLLM's futures on vLLM's loop. ``PendingCalls`` keeps one
callback per call (beside the in-flight count's, ``InProcessFleetClient._send``): it notes when
the call resolved (an engine's duration is its own round trip, not the fan-out's, which a hung
engine stretches to the deadline) and wakes the fan-out when the last one did. ``asyncio.wait``
would add and remove one more callback per call besides, and build two sets.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from exporter.client.fleet import SHUTTING_DOWN, EngineOutcome, Outcome, stopping
from exporter.client.inprocess.vllm_core import is_engine_dead_error
from exporter.protocol.strings import bound_text, bound_value

ENGINE_CORE_DEAD = "vLLM's engine-core client reports an engine dead (EngineDeadError)"


class PendingCalls:
    """The calls of one fan-out until each resolved or the deadline passed."""

    __slots__ = ("_left", "_waiter", "finished", "started")

    def __init__(self) -> None:
        self.started = time.perf_counter()
        #: When each call resolved (``time.perf_counter``).
        self.finished: dict[asyncio.Task[Any], float] = {}
        self._left = 0
        self._waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def expect(self) -> None:
        """One more call is on its way (``resolved`` is called when it resolves)."""
        self._left += 1

    def resolved(self, task: asyncio.Task[Any]) -> None:
        self.finished[task] = time.perf_counter()
        self._left -= 1
        if self._left <= 0:
            self._wake()

    async def wait(self, timeout_s: float) -> None:
        """Until every expected call resolved, or ``timeout_s`` passed."""
        if self._left <= 0:
            return
        timer = asyncio.get_running_loop().call_later(timeout_s, self._wake)
        try:
            await self._waiter
        finally:
            timer.cancel()

    def _wake(self) -> None:
        if not self._waiter.done():
            self._waiter.set_result(None)

    def outcome(self, label: str, task: asyncio.Task[Any], closed: bool) -> EngineOutcome:
        """The outcome of ``task``, a call to engine ``label`` that resolved (``closed``: the
        client was closed, a cancelled call is then the client's stop)."""
        if task.cancelled():
            if closed:
                return stopping(label)
            return EngineOutcome(label, Outcome.DISCONNECTED, error="call cancelled")
        elapsed = self.finished.get(task, time.perf_counter()) - self.started
        exc = task.exception()
        if exc is None:
            return EngineOutcome(label, Outcome.OK, bound_value(task.result()), duration_s=elapsed)
        if is_engine_dead_error(exc):
            return EngineOutcome(label, Outcome.DISCONNECTED, error=ENGINE_CORE_DEAD)
        if type(exc) is Exception:  # vLLM's wrapper of the engine's failure message
            message = str(exc)
            return EngineOutcome(
                label,
                Outcome.FAILED,
                error=bound_text(message),
                shutting_down=message == SHUTTING_DOWN,
                duration_s=elapsed,
            )
        # A send that failed (a closed socket, vLLM shutting down): no engine answered.
        return EngineOutcome(
            label,
            Outcome.DISCONNECTED,
            error=bound_text(f"{type(exc).__name__}: {exc}"),
        )
