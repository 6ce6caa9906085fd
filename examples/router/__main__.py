"""``python -m examples.router --upstream http://127.0.0.1:8000
--watch http://127.0.0.1:19400/watch --listen 127.0.0.1:8100`` (README.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence

from examples.router.router import Router, RouterConfig, serve


def listen_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:8100`` for IPv6)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m examples.router",
        description="Route OpenAI requests to one vLLM front end, pinning each to a routable "
        "DP rank (X-data-parallel-rank) from the exporter's feed.",
    )
    p.add_argument("--upstream", required=True, help="vLLM's URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--watch",
        required=True,
        help="the exporter's feed: http://EXPORTER:19400/watch, or http://VLLM:8000/dp/watch",
    )
    p.add_argument("--listen", type=listen_address, default=("127.0.0.1", 8100))
    p.add_argument(
        "--first-rank",
        type=int,
        default=0,
        help="the DP rank of the front end's first engine (hybrid / external LB); default 0",
    )
    p.add_argument(
        "--stale-after",
        type=float,
        default=15.0,
        help="seconds without a feed event before requests go unpinned (vLLM balances them)",
    )
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    config = RouterConfig(
        upstream=args.upstream,
        watch=args.watch,
        first_rank=args.first_rank,
        stale_after_s=args.stale_after,
    )
    router = Router(config)
    host, port = args.listen
    runner, url = await serve(router, host, port)
    logging.getLogger("examples.router").info("routing %s on %s", config.upstream, url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await router.close()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(run(parse(argv)))


if __name__ == "__main__":
    main()
