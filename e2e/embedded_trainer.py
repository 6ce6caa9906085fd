"""A trainer's process: it owns an ``AsyncLLM`` with 2 DP engines and runs the exporter in it.

Run with vLLM's Python, with the checkout installed in vLLM's environment
(``e2e.plugin_install``)::

    python embedded_trainer.py MODEL --token-file FILE [--listen 127.0.0.1:0]
        [--admin-listen 127.0.0.1:0] [--data-parallel-size 2]

What a user of ``exporter.inprocess.start_exporter`` writes: the ``AsyncLLM`` is built in the
running event loop, the exporter is started in that same loop over it, a few tokens are
generated, and the process serves until SIGTERM or SIGINT; then it stops the exporter, shuts
the ``AsyncLLM`` down and exits 0. It prints one JSON line per step on stdout
(``{"event": "ready", "url": ..., "admin_url": ..., "tokens": N}`` once serving), which is
how the suite finds the ports the OS chose.

Unlike the rest of ``e2e/``, this file imports the exporter: it is the user's program, not the
suite; it runs in vLLM's environment, never in the suite's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import signal
import sys
import time
from typing import Any

# The tiny model's settings in every other e2e command line (e2e/vllm_runtime.py).
MAX_MODEL_LEN = 4096
DTYPE = "float32"
SERVED_NAME = "tiny"
PROMPT = "w1 w2 w3 w4"
WARMUP_TOKENS = 8


def say(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, "t": round(time.monotonic(), 3), **fields}), flush=True)


async def generate(llm: Any, prompt: str, max_tokens: int, request_id: str) -> int:
    """One greedy generation of exactly ``max_tokens`` tokens; returns how many came out."""
    from vllm import SamplingParams  # type: ignore[import-not-found]

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    tokens = 0
    async for output in llm.generate(prompt, params, request_id=request_id):
        tokens = len(output.outputs[0].token_ids)
    return tokens


async def run(args: argparse.Namespace) -> int:
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found]

    from exporter.inprocess import start_exporter

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    engine_args = AsyncEngineArgs(
        model=args.model,
        served_model_name=[SERVED_NAME],
        data_parallel_size=args.data_parallel_size,
        dtype=DTYPE,
        max_model_len=MAX_MODEL_LEN,
        enforce_eager=True,
    )
    say("starting", data_parallel_size=args.data_parallel_size)
    llm = AsyncLLM.from_engine_args(engine_args)
    try:
        service = await start_exporter(
            llm,
            listen=args.listen,
            admin_listen=args.admin_listen,
            poll_interval=1.0,
            admin_token_file=args.token_file,
            reset_min_interval=0.0,
        )
        try:
            tokens = await generate(llm, PROMPT, WARMUP_TOKENS, "warmup")
            say("ready", url=service.url, admin_url=service.admin_url, tokens=tokens)
            await stop.wait()
            say("stopping")
        finally:
            await service.stop()
    finally:
        llm.shutdown()
    say("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("model")
    p.add_argument("--token-file", required=True)
    p.add_argument("--listen", default="127.0.0.1:0")
    p.add_argument("--admin-listen", default="127.0.0.1:0")
    p.add_argument("--data-parallel-size", type=int, default=2)
    code = asyncio.run(run(p.parse_args(argv)))
    # The AsyncLLM is in reference cycles: collected now, its __del__ (a second, idempotent
    # shutdown) runs while vLLM's modules are still loaded, not at interpreter teardown.
    gc.collect()
    return code


if __name__ == "__main__":
    sys.exit(main())
