"""What vLLM's own client costs for the calls a poll makes, measured alone (``bench.plugin_loop``).

The CPU a poll adds to vLLM's process is partly vLLM's own: each utility call is encoded,
written to the engine's socket, its reply read and decoded by vLLM's output reader and its
future resolved (here by the simulated client, ``bench.sim_vllm``, on the same sockets), and
concurrent calls through vLLM's ``_call_utility_async`` are one task each. Measured in the same
run, with the exporter stopped: the read methods of a poll sent to every engine a burst at a
time, every method of a burst at once (``asyncio.gather`` of vLLM's own call), rounds apart,
the median CPU per call taken. A poll's CPU less these calls' share is the exporter's own.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from exporter.config.settings import ServeConfig

#: The methods a listening poll asks every engine (``has_work`` is told by the counts).
POLLED = ("is_sleeping", "is_scheduler_paused", "get_weight_version")


async def client_cpu_per_call(
    llm: Any, rounds: int = 12, engines_per_burst: int | None = None
) -> float:
    """Median seconds of this process's CPU per utility call vLLM's client makes alone, a
    burst of ``engines_per_burst`` engines at a time (None: the exporter's default; 0: every
    engine at once)."""
    core = llm.engine_core
    identities = list(core.core_engines)
    if engines_per_burst is None:  # the exporter's default
        engines_per_burst = ServeConfig().engines_per_burst
    per_burst = engines_per_burst or len(identities)  # 0: every engine at once
    bursts = [identities[i : i + per_burst] for i in range(0, len(identities), per_burst)]
    samples = []
    for round_index in range(rounds + 2):
        cpu = time.process_time()
        for burst in bursts:
            # A poll's burst asks its engines every method at once: so here.
            await asyncio.gather(
                *(core._call_utility_async(m, engine=i) for m in POLLED for i in burst)
            )
        spent = time.process_time() - cpu
        if round_index >= 2:  # the first rounds warm the sockets and caches
            samples.append(spent / (len(identities) * len(POLLED)))
        await asyncio.sleep(0.05)
    return statistics.median(samples)
