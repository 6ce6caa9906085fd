"""Routing around a stopped engine inside one real ``vllm serve --data-parallel-size 2`` with the
``dp_exporter`` plugin in-process (docs/routing.md): vLLM's own answers to the
``X-data-parallel-rank`` header (a rank it has, one it does not, one that is no integer), then
``SIGSTOP`` on rank 1's engine process: ``/dp/watch`` carries rank 1 not routable (a poll's call
timed out), then hung within ``--hung-after`` plus two polls (a poll: its interval and its call
timeout), the example router (``examples/router``, following ``/dp/watch``) finishes every
completion meanwhile, all on rank 0, the same completions sent straight to vLLM are reported
beside them (how many waited for the stopped rank: printed, not asserted, that is vLLM's
balancing), and after ``SIGCONT`` rank 1 is routable again and takes the router's traffic again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from aiohttp import web as aioweb

from e2e import plugin_install, web
from e2e.inprocess import (
    PLUGIN,
    Endpoint,
    PluginServer,
    vllm_env,
    wait_every_api_server,
    write_token,
)
from e2e.ports import HOST, free_port
from e2e.procs import ProcessGroup, first_exited
from e2e.traffic import complete
from e2e.vllm_features import ENDPOINT_PLUGINS
from e2e.vllm_runtime import SERVED_NAME, VllmRuntime, engine_core_pids, wait_api_ready
from examples.router.router import DP_RANK_HEADER, Router, RouterConfig, serve

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_needs(ENDPOINT_PLUGINS)]

POLL_S = 1.0
CALL_TIMEOUT_S = 2.0
HUNG_AFTER_S = 4.0
#: "Within --hung-after plus two polls", a poll being its interval plus its call timeout (the
#: longest a poll that asks the stopped rank takes).
HUNG_WITHIN_S = HUNG_AFTER_S + 2 * (POLL_S + CALL_TIMEOUT_S)
#: Routable again within two polls of answering (and the feed's push).
BACK_WITHIN_S = 2 * (POLL_S + CALL_TIMEOUT_S) + 1.0
COMPLETIONS = 8
MAX_TOKENS = 4
#: How long the completions sent straight to vLLM get before SIGCONT (those still open then
#: are waiting for the stopped rank).
DIRECT_WAIT_S = 20.0
PROMPT = "w1 w2 w3"


def body(stream: bool = False) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }


class RouterThread:
    """The example router on an event loop of its own, in a thread (the suite is blocking)."""

    def __init__(self, upstream: str, watch: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.router = Router(RouterConfig(upstream, watch, reconnect_s=0.5))
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(serve(self.router, HOST, 0), self.loop)
        self.runner, self.url = started.result(timeout=30)

    def stats(self) -> dict[str, Any]:
        reply = web.get(f"{self.url}/stats")
        assert reply.status == 200, reply
        answer: dict[str, Any] = reply.json()
        return answer

    def routable(self) -> dict[str, bool]:
        return {r["engine"]: r["routable"] for r in self.stats()["ranks"]}

    def close(self) -> None:
        async def stop(runner: aioweb.AppRunner) -> None:
            await runner.cleanup()
            await self.router.close()

        asyncio.run_coroutine_threadsafe(stop(self.runner), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def served(
    runtime: VllmRuntime, procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory
) -> PluginServer:
    """``vllm serve`` with 2 DP engines (2 API servers) and the plugin polling every second,
    ``--hung-after`` and ``--call-timeout`` set so a stopped rank reads hung in seconds."""
    assert plugin_install.install(runtime.version).venv == runtime.venv
    token_file, token = write_token(tmp_path_factory.mktemp("routing-token"))
    port = free_port()
    api_url = f"http://{HOST}:{port}"
    settings = {
        "POLL_INTERVAL": str(POLL_S),
        "CALL_TIMEOUT": str(CALL_TIMEOUT_S),
        "HUNG_AFTER": str(HUNG_AFTER_S),
        "ADMIN_TOKEN_FILE": str(token_file),
    }
    env = vllm_env(runtime, PLUGIN, settings)
    server = procs.start(
        "vllm-serve-routing", runtime.data_parallel_server(port, 2), env, cwd=procs.log_dir
    )
    wait_api_ready(api_url, server)
    endpoint = Endpoint(api_url, api_url, "/dp", token)
    wait_every_api_server(endpoint, 2, server)
    return PluginServer(server, api_url, endpoint)


@pytest.fixture(scope="module")
def router(served: PluginServer) -> Iterator[RouterThread]:
    routing = RouterThread(served.api_url, f"{served.api_url}/dp/watch")
    try:
        web.wait_for(
            lambda: routing.routable() == {"0": True, "1": True},
            60,
            "the router's table: both ranks routable",
            abort=lambda: first_exited(served.server),
        )
        yield routing
    finally:
        routing.close()


def test_vllm_answers_the_header_as_its_source_says(served: PluginServer) -> None:
    """Pinned to each rank: 200. A rank it does not have: 400 ``BadRequestError`` (streamed: a
    200 whose one event is that error, then ``[DONE]``). Not an integer: ignored (200)."""
    url = f"{served.api_url}/v1/completions"
    for rank in ("0", "1", "one"):
        reply = web.request("POST", url, body(), 120.0, {DP_RANK_HEADER: rank})
        assert reply.status == 200, (rank, reply)
    reply = web.request("POST", url, body(), 60.0, {DP_RANK_HEADER: "2"})
    assert reply.status == 400, reply
    error = reply.json()["error"]
    print(f"\nX-data-parallel-rank: 2 → {reply.status} {json.dumps(error)}")
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    reply = web.request("POST", url, body(stream=True), 60.0, {DP_RANK_HEADER: "-1"})
    print(f"X-data-parallel-rank: -1, streamed → {reply.status} {reply.body.decode()!r}")
    assert reply.status == 200
    events = [e for e in reply.body.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    (streamed,) = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert (
        streamed["error"]["code"] == 400 and "out of range [0, 2)" in streamed["error"]["message"]
    )


def direct(api_url: str) -> tuple[int, float]:
    """One completion straight to vLLM (its own balancing): status and when it ended."""
    reply = web.post(f"{api_url}/v1/completions", body(), timeout_s=300.0)
    return reply.status, time.monotonic()


def hung_row(router: RouterThread) -> dict[str, Any] | None:
    """Rank 1's row in the router's table once a reason says ``hung:``."""
    (row,) = [r for r in router.stats()["ranks"] if r["engine"] == "1"]
    reasons = [str(r) for r in row["reasons"] or ()]
    return row if any(r.startswith("hung:") for r in reasons) else None


def test_a_stopped_engine_gets_no_request_through_the_router(
    served: PluginServer, router: RouterThread
) -> None:
    pid = engine_core_pids(served.server)[1]
    before = router.stats()["requests"].get("1", 0)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    continued_at: float | None = None
    pool = ThreadPoolExecutor(COMPLETIONS)
    straight: list[Future[tuple[int, float]]] = []
    try:
        web.wait_for(
            lambda: router.routable() == {"0": True, "1": False},
            HUNG_WITHIN_S + 30,
            "rank 1 not routable in the router's table (from /dp/watch)",
            interval_s=0.1,
            abort=lambda: first_exited(served.server),
        )
        unroutable_s = time.monotonic() - stopped_at
        hung = web.wait_for(
            lambda: hung_row(router),
            HUNG_WITHIN_S + 30,
            "rank 1 hung in the router's table",
            interval_s=0.1,
            abort=lambda: first_exited(served.server),
        )
        hung_s = time.monotonic() - stopped_at
        print(
            f"\nafter SIGSTOP, rank 1 not routable in {unroutable_s:.1f} s (a poll's timeout), "
            f"hung in {hung_s:.1f} s: {hung['reasons']}"
        )
        assert hung["routable"] is False
        assert hung_s <= HUNG_WITHIN_S, f"{hung_s:.1f} s > --hung-after + two polls"

        straight = [pool.submit(direct, served.api_url) for _ in range(COMPLETIONS)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(COMPLETIONS) as routing_pool:
            routed = list(
                routing_pool.map(
                    lambda _: complete(router.url, PROMPT, MAX_TOKENS), range(COMPLETIONS)
                )
            )
        routed_s = time.monotonic() - t0
        assert len(routed) == COMPLETIONS and all(r["choices"] for r in routed)
        stats = router.stats()
        assert stats["requests"].get("1", 0) == before, "none to the stopped rank"
        assert stats["refused"] == 0 and stats["failed"] == 0 and stats["unpinned"] == 0

        deadline = time.monotonic() + DIRECT_WAIT_S
        while time.monotonic() < deadline and not all(f.done() for f in straight):
            time.sleep(0.2)
        waiting = sum(not f.done() for f in straight)
    finally:
        os.kill(pid, signal.SIGCONT)
        continued_at = time.monotonic()
    results = [f.result(timeout=300) for f in straight]
    pool.shutdown()
    assert all(status == 200 for status, _ in results), results
    late = sum(ended > continued_at for _, ended in results)
    print(
        f"{COMPLETIONS} completions through the router: all finished in {routed_s:.1f} s while "
        f"rank 1 was stopped; the same {COMPLETIONS} straight to vLLM: {waiting} still waiting "
        f"after {DIRECT_WAIT_S:.0f} s, {late} finished only after SIGCONT"
    )
    assert late >= waiting  # still open at SIGCONT: they can only end after it

    web.wait_for(
        lambda: router.routable() == {"0": True, "1": True},
        BACK_WITHIN_S + 30,
        "rank 1 routable again",
        interval_s=0.1,
        abort=lambda: first_exited(served.server),
    )
    back = time.monotonic() - continued_at
    print(f"rank 1 routable again {back:.1f} s after SIGCONT")
    assert back <= BACK_WITHIN_S
    for _ in range(4):
        complete(router.url, PROMPT, MAX_TOKENS)
    assert router.stats()["requests"].get("1", 0) > before, "rank 1 takes traffic again"


def test_the_router_answers_503_when_no_rank_is_routable(
    served: PluginServer, router: RouterThread
) -> None:
    """Both engines stopped: no rank routable, the router answers 503 itself."""
    pids = engine_core_pids(served.server)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        web.wait_for(
            lambda: router.routable() == {"0": False, "1": False},
            HUNG_WITHIN_S + 30,
            "no rank routable",
            interval_s=0.1,
            abort=lambda: first_exited(served.server),
        )
        refused = router.stats()["refused"]
        reply = web.post(f"{router.url}/v1/completions", body(), timeout_s=30.0)
        assert reply.status == 503, reply
        assert reply.json()["error"]["type"] == "ServiceUnavailableError"
        assert router.stats()["refused"] == refused + 1
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGCONT)
    web.wait_for(
        lambda: router.routable() == {"0": True, "1": True},
        BACK_WITHIN_S + 30,
        "both ranks routable again",
        interval_s=0.1,
        abort=lambda: first_exited(served.server),
    )
    assert complete(router.url, PROMPT, MAX_TOKENS)["choices"]
