"""The simulated API server's ``POST /v1/completions`` over real HTTP, as the example router
needs it: ``X-data-parallel-rank`` pins a request to its engine (counted per engine) as vLLM 0.30
to 0.34 do, a rank out of range is vLLM's 400 (a streamed request's error event in a 200), a
header that is not an integer is ignored (vLLM balances the request), a request on a paused
engine waits until it resumes, and a stream's first chunk comes before its end."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from exporter.sim.api_routes import DP_RANK_HEADER
from tests.harness.apiservers import StartApi
from tests.harness.waiting import eventually

TIMEOUT = aiohttp.ClientTimeout(total=20)


async def post(
    url: str, rank: str | None = None, **body: Any
) -> tuple[int, str, CIMultiDictProxy[str]]:
    headers = {} if rank is None else {DP_RANK_HEADER: rank}
    payload = {"model": "m", "prompt": "hi", "max_tokens": 2, **body}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(url + "/v1/completions", json=payload, headers=headers) as resp,
    ):
        return resp.status, await resp.text(), resp.headers


async def test_the_header_pins_each_request_to_its_engine(start_api: StartApi) -> None:
    api = await start_api(engines=3)
    for rank in ("2", "2", "0", " 1 "):  # int() as vLLM reads it: surrounding spaces pass
        status, text, _ = await post(api.url, rank)
        assert status == 200, text
        assert json.loads(text)["object"] == "text_completion"
    assert api.sim.completions == {2: 2, 0: 1, 1: 1}
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            api.url + "/v1/chat/completions",
            json={"model": "m", "messages": [], "max_tokens": 1},
            headers={DP_RANK_HEADER: "1"},
        ) as resp,
    ):
        assert resp.status == 200 and (await resp.json())["object"] == "chat.completion"
    assert api.sim.completions[1] == 2


async def test_a_rank_it_does_not_have_is_vllms_400(start_api: StartApi) -> None:
    api = await start_api(engines=2)
    for rank in ("2", "-1", "99"):
        status, text, _ = await post(api.url, rank)
        assert status == 400
        assert json.loads(text) == {
            "error": {
                "message": f"data_parallel_rank {rank} is out of range [0, 2).",
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            }
        }
    status, text, headers = await post(api.url, "5", stream=True)
    assert status == 200 and str(headers["Content-Type"]).startswith("text/event-stream")
    events = [block for block in text.split("\n\n") if block]
    assert events[-1] == "data: [DONE]"
    (error,) = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert error["error"]["code"] == 400 and "out of range [0, 2)" in error["error"]["message"]
    assert not api.sim.completions, "no engine was given a request"


async def test_a_header_that_is_not_an_integer_is_balanced_by_vllm(start_api: StartApi) -> None:
    api = await start_api(engines=2)
    for rank in ("one", "1.0", "", None, None, None):
        status, text, _ = await post(api.url, rank)
        assert status == 200, text
    assert sum(api.sim.completions.values()) == 6
    assert set(api.sim.completions) == {0, 1}, "the scan start rotates: both engines get some"


async def test_a_request_on_a_paused_engine_waits_until_it_resumes(start_api: StartApi) -> None:
    api = await start_api(engines=2)
    api.sim.engines[1].paused = True
    pinned = asyncio.create_task(post(api.url, "1"))
    await eventually(lambda: api.sim.completions[1] == 1, what="the request on engine 1")
    status, _, _ = await post(api.url, "0")  # the other engine answers meanwhile
    assert status == 200
    await asyncio.sleep(0.3)
    assert not pinned.done(), "a paused engine runs nothing"
    assert api.sim.engines[1].request_counts(time.monotonic()) == (0, 1)
    api.sim.engines[1].paused = False
    status, _, _ = await asyncio.wait_for(pinned, 10)
    assert status == 200


async def test_a_stream_sends_its_first_chunk_before_its_end(start_api: StartApi) -> None:
    api = await start_api(engines=1)
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as session,
        session.post(
            api.url + "/v1/completions",
            json={"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True},  # 1 s
        ) as resp,
    ):
        assert resp.status == 200
        started = time.monotonic()
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"data: {") and time.monotonic() - started < 0.8
        rest = await asyncio.wait_for(resp.content.read(), 10)
        assert rest.endswith(b"data: [DONE]\n\n") and time.monotonic() - started > 0.5
