"""Background tasks that never die silently.

``supervise`` runs a long-lived loop (a handshake socket, the poller) and restarts it after an
unexpected exception, with a growing delay; ``watch`` attaches the same accounting to a one-shot
task. Either way the failure is logged (rate-limited) and counted in
``vllm_dp_task_failures_total{task}`` through the shared ``ProtocolErrorTally``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from exporter.base.faults import ProtocolErrorTally

RESTART_DELAYS_S = (0.05, 0.2, 1.0, 5.0)


def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    faults: ProtocolErrorTally,
    *,
    delays_s: tuple[float, ...] = RESTART_DELAYS_S,
) -> asyncio.Task[None]:
    """Start ``run()`` as a task that is restarted whenever it raises (not when it returns or
    is cancelled). The delay grows along ``delays_s`` and resets after a clean hour."""

    async def loop() -> None:
        failures = 0
        while True:
            started = asyncio.get_running_loop().time()
            try:
                await run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the point of a supervisor: log, count, restart
                faults.task_failed(name, exc)
                if asyncio.get_running_loop().time() - started > 3600:
                    failures = 0
                await asyncio.sleep(delays_s[min(failures, len(delays_s) - 1)])
                failures += 1

    return asyncio.get_running_loop().create_task(loop(), name=name)


def watch(task: asyncio.Task[object], name: str, faults: ProtocolErrorTally) -> None:
    """Count and log the exception of a one-shot background task when it ends with one."""

    def done(t: asyncio.Task[object]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            faults.task_failed(name, exc)

    task.add_done_callback(done)


async def cancel_and_wait(task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` and wait for it to end (its cancellation is not an error)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
