"""Inference traffic through vLLM's OpenAI front end: what a real user of the deployment does
while the exporter polls and resets."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from e2e import web
from e2e.vllm_runtime import SERVED_NAME


def _body(prompt: str, max_tokens: int, ignore_eos: bool, stream: bool) -> dict[str, Any]:
    """A greedy completion request for the tiny model."""
    body: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def complete(
    api_url: str, prompt: str, max_tokens: int, timeout_s: float = 120.0
) -> dict[str, Any]:
    """One greedy completion (stops at EOS or ``max_tokens``); raises on anything but 200."""
    reply = web.post(
        f"{api_url}/v1/completions", _body(prompt, max_tokens, False, False), timeout_s
    )
    assert reply.status == 200, f"completion answered {reply.status}: {reply.body[:300]!r}"
    body: dict[str, Any] = reply.json()
    return body


def completions_while_resetting(
    api_url: str,
    prompt: str,
    reset: Callable[[], web.Reply],
    count: int = 8,
    max_tokens: int = 128,
) -> tuple[list[dict[str, Any]], list[web.Reply]]:
    """``count`` completions on 2 client threads while ``reset`` runs back to back (every
    0.2 s, preempting running requests): the completions and every reset's answer."""
    resets: list[web.Reply] = []
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(complete, api_url, f"{prompt} w{i}", max_tokens) for i in range(count)
        ]
        while not all(f.done() for f in futures):
            resets.append(reset())
            time.sleep(0.2)
        during = [f.result(timeout=60) for f in futures]
    return during, resets


#: The request header that pins a request to a DP rank (vLLM 0.30+, docs/routing.md).
RANK_HEADER = "X-data-parallel-rank"


class LongGeneration:
    """A streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``) on a thread.

    ``started`` is set when the first token arrives: from then on, until ``finished``, the
    request is running on its engine and holds KV-cache blocks there. Polling vLLM's
    ``num_requests_running`` gauge instead is not exact (it is refreshed only while the engine
    steps, so it can stay stale after the requests ended). ``headers``: extra request headers
    (``{"X-data-parallel-rank": "1"}`` pins it to a DP rank, docs/routing.md).
    """

    def __init__(
        self,
        api_url: str,
        prompt: str,
        max_tokens: int,
        timeout_s: float = 600.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.started = threading.Event()
        self.finished = threading.Event()
        self.sent_at = time.monotonic()
        #: When the first token arrived and when the stream ended (monotonic; diagnostics).
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.chunks = 0
        self.completion_tokens: int | None = None  # from the final usage chunk
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        request = urllib.request.Request(
            f"{api_url}/v1/completions",
            data=json.dumps(_body(prompt, max_tokens, True, True)).encode(),
            headers={"Content-Type": "application/json", **(headers or {})},
            method="POST",
        )
        self._thread = threading.Thread(target=self._run, args=(request, timeout_s), daemon=True)
        self._thread.start()

    def _run(self, request: urllib.request.Request, timeout_s: float) -> None:
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk.get("usage"):
                        self.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or ():
                        self.chunks += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                        if self.first_token_at is None:
                            self.first_token_at = time.monotonic()
                        self.started.set()
        except BaseException as exc:  # reported by result(), never lost in the thread
            self.error = exc
        finally:
            self.finished_at = time.monotonic()
            self.started.set()
            self.finished.set()

    def timeline(self, since: float) -> str:
        """``first token +Xs, ended +Ys`` relative to ``since`` (diagnostics)."""

        def at(t: float | None) -> str:
            return "-" if t is None else f"+{t - since:.1f}s"

        return (
            f"first token {at(self.first_token_at)}, ended {at(self.finished_at)} "
            f"({self.chunks} chunks, finish reason {self.finish_reason!r}"
            f"{'' if self.error is None else f', error {self.error!r}'})"
        )

    def result(self, timeout_s: float) -> int | None:
        """Wait (bounded) for the end; returns the completion's token count (vLLM's usage)."""
        if not self.finished.wait(timeout_s):
            raise AssertionError(f"generation still running after {timeout_s:.0f} s")
        if self.error is not None:
            raise AssertionError(f"generation failed: {self.error!r}") from self.error
        return self.completion_tokens


def start_long_generations(
    api_url: str,
    count: int,
    max_tokens: int,
    start_timeout_s: float = 120.0,
    *,
    allow_ended: bool = False,
    wait_all: bool = True,
) -> list[LongGeneration]:
    """Start ``count`` long generations and wait until each one (``wait_all=False``: the
    first one) streamed its first token. A generation that failed raises; one that already
    ended raises unless ``allow_ended`` (the caller then checks ``finished`` itself)."""
    gens = [LongGeneration(api_url, f"w{i} w{i + 1} w{i + 2}", max_tokens) for i in range(count)]
    waited = gens
    if not wait_all:
        deadline = time.monotonic() + start_timeout_s
        while not any(g.started.is_set() for g in gens):
            if time.monotonic() > deadline:
                raise AssertionError(f"no first token within {start_timeout_s:.0f} s")
            time.sleep(0.01)
        waited = [g for g in gens if g.started.is_set()]
    for gen in waited:
        if not gen.started.wait(start_timeout_s):
            raise AssertionError(f"no first token within {start_timeout_s:.0f} s")
        if gen.error is not None:
            raise AssertionError(f"generation failed: {gen.error!r}") from gen.error
        if gen.finished.is_set() and not allow_ended:
            raise AssertionError(
                f"generation ended before the test could use it: {gen.chunks} chunks, "
                f"finish reason {gen.finish_reason!r}"
            )
    return gens


#: How long vLLM's ``POST /pause`` may take to land on the engines (and to answer): on this
#: 2-core machine a front end whose generations wait for a slot took it once 66 s late.
PAUSE_WAIT_S = 150.0


def paused_states(status: dict[str, Any]) -> list[Any]:
    """Each engine's ``is_scheduler_paused`` in an exporter's /status (None: no answer)."""
    return [e["invariants"]["is_scheduler_paused"].get("value") for e in status["engines"]]


@contextlib.contextmanager
def paused_keeping_requests(
    api_url: str,
    status: Callable[[], dict[str, Any]],
    admin: Callable[..., web.Reply] | None = None,
) -> Iterator[None]:
    """The engines paused with ``mode=keep&clear_cache=false`` (running requests and their KV
    blocks kept) for the ``with`` block, then resumed: by vLLM's front end (``POST /pause``),
    or, given ``admin`` (an exporter's ``admin(action, **query)``), by the exporter's own
    verified action, straight to the engines.

    The pause may land late (a front end streaming a dozen generations on 2 cores sent it
    after the generations had ended), so it runs in the background and the block starts once
    the exporter (``status``: its /status) sees every engine's scheduler paused, or the pause
    answers. The
    resume is sent only after the pause answered (a late pause would undo an earlier resume
    and leave the engines paused), then every engine is seen running again.
    """
    pool = ThreadPoolExecutor(1)
    if admin is None:
        url = f"{api_url}/pause?mode=keep&clear_cache=false"
        pause = pool.submit(web.post, url, timeout_s=PAUSE_WAIT_S)
    else:
        pause = pool.submit(admin, "pause", mode="keep", clear_cache="false")
    try:
        web.wait_for(
            lambda: pause.done() or all(v is True for v in paused_states(status())),
            PAUSE_WAIT_S,
            "the pause on every engine",
        )
        if pause.done():
            assert pause.result().status == 200, pause.result().body
        yield
    finally:
        with contextlib.suppress(Exception):
            pause.result(PAUSE_WAIT_S)
        pool.shutdown(wait=False)
        # Resumed, the generations stream at once: the busy front end may answer late.
        resumed = web.post(f"{api_url}/resume", timeout_s=60) if admin is None else admin("resume")
        assert resumed.status == 200, resumed.body
        web.wait_for(
            lambda: all(v is False for v in paused_states(status())), 30, "every engine resumed"
        )


def front_end_generated(api: str) -> dict[str, float]:
    """Engine → the front end's own ``vllm:generation_tokens_total`` (one API server, so its
    per-engine series have samples). A counter, so the rank vLLM's load balancer gave a
    generation is the one whose count grows; its ``vllm:num_requests_running`` gauge can
    still hold an earlier request's 1 (refreshed only while that engine steps)."""
    scrape = web.Scrape(web.get(f"{api}/metrics").body.decode())
    return {
        str(s.labels["engine"]): float(s.value)
        for s in scrape.find("vllm:generation_tokens_total")
        if "engine" in s.labels
    }
