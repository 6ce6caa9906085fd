"""What vLLM's own client costs for the calls a poll makes, measured alone (``bench.plugin_loop``).

The CPU a poll adds to vLLM's process is partly vLLM's own: each utility call is encoded,
written to the engine's socket, its reply read and decoded by vLLM's output reader and its
future resolved (here by the simulated client, ``bench.sim_vllm``, on the same sockets), and
concurrent calls through vLLM's ``_call_utility_async`` are one task each. Measured in the same
run, with the exporter stopped: the read methods of a poll sent to every engine a burst at a
time, every method of a burst at once (``asyncio.gather`` of vLLM's own call), each burst at
its offset in the poll interval as a paced poll sends it (``exporter.control.pacing``): a burst
alone wakes the loop, the ZMQ I/O thread and the engines, as in a poll; bursts back to back
would share those wake-ups and understate it. The same interval with no call is measured
beside each round and taken off (what the process does anyway: vLLM's coordinator table). The
median CPU per call is taken; a poll's CPU less these calls' share is the exporter's own.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from exporter.config.settings import ServeConfig
from exporter.control.pacing import bursts, offsets

#: The methods a listening poll asks every engine (``has_work`` is told by the counts).
POLLED = ("is_sleeping", "is_scheduler_paused", "get_weight_version")


async def _round(core: Any, groups: list[tuple[Any, ...]], interval_s: float, calls: bool) -> float:
    """This process's CPU seconds over one interval that sends ``groups`` at their offsets
    (``calls`` False: the same interval, nothing sent)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    cpu = time.process_time()
    for group, offset in zip(groups, offsets(len(groups), interval_s), strict=True):
        await asyncio.sleep(max(0.0, start + offset - loop.time()))
        if calls:  # a poll's burst asks its engines every method at once: so here
            await asyncio.gather(
                *(core._call_utility_async(m, engine=i) for m in POLLED for i in group)
            )
    await asyncio.sleep(max(0.0, start + interval_s - loop.time()))
    return time.process_time() - cpu


async def client_cpu_per_call(
    llm: Any, rounds: int = 12, engines_per_burst: int | None = None, interval_s: float = 1.0
) -> float:
    """Median seconds of this process's CPU per utility call vLLM's client makes alone, a
    burst of ``engines_per_burst`` engines at a time at the burst's offset in ``interval_s``
    (None: the exporter's default; 0: every engine at once)."""
    core = llm.engine_core
    identities = list(core.core_engines)
    if engines_per_burst is None:  # the exporter's default
        engines_per_burst = ServeConfig().engines_per_burst
    groups = bursts(identities, engines_per_burst)
    samples = []
    for round_index in range(rounds + 2):
        spent = await _round(core, groups, interval_s, calls=True)
        idle = await _round(core, groups, interval_s, calls=False)
        if round_index >= 2:  # the first rounds warm the sockets and caches
            samples.append((spent - idle) / (len(identities) * len(POLLED)))
    return statistics.median(samples)
