"""What vLLM's ``AsyncLLM`` records beside a collective sleep, wake-up or pause (its front-end
multimodal cache cleared, the sleep state behind ``vllm:engine_sleep_state``) is recorded when
the same action runs per engine through in-process mode, and only when every engine confirmed
it: vLLM's own series do not go stale (relay mode refuses these actions for that reason)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from exporter.sim.options import SimReply
from exporter.web.app import RunningService
from tests.harness.inprocess import (
    ADMIN_TOKEN,
    EmbeddedExporters,
    SimVllmFactory,
    http_session,
    token_file,
)


async def post(
    session: aiohttp.ClientSession, service: RunningService, action: str, query: str = ""
) -> tuple[int, Any]:
    assert service.admin_url is not None
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    url = f"{service.admin_url}/admin/{action}{query}"
    async with session.post(url, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_sleep_wake_and_pause_keep_vllms_own_state_in_step(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters, tmp_path: Path
) -> None:
    sim = await sim_vllm_factory(2)
    llm = sim.llm
    service = await embedded(llm, admin_token_file=token_file(tmp_path))
    async with http_session() as session:
        status, body = await post(session, service, "sleep", "?level=1")
        assert status == 200, body
        assert llm.logger_manager.sleep_states == [(1, 1)]
        assert llm.renderer.mm_cache_clears == 1
        status, body = await post(session, service, "wake_up")
        assert status == 200, body
        assert llm.logger_manager.sleep_states == [(1, 1), (0, 0)]
        # The engines' pause_scheduler clears their caches by default: so does vLLM's front end.
        status, body = await post(session, service, "pause", "?mode=keep")
        assert status == 200, body
        assert llm.renderer.mm_cache_clears == 2
        status, body = await post(session, service, "resume")
        assert status == 200, body
        assert llm.renderer.mm_cache_clears == 2
        assert llm.logger_manager.sleep_states == [(1, 1), (0, 0)]


async def test_an_action_one_engine_failed_records_nothing(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters, tmp_path: Path
) -> None:
    sim = await sim_vllm_factory(3)

    def refuse_sleep(
        client_index: int, call_id: int, method: str, args: list[Any]
    ) -> SimReply | None:
        return SimReply(failure="Sleep mode is not enabled") if method == "sleep" else None

    sim.script(2, refuse_sleep)
    service = await embedded(sim.llm, admin_token_file=token_file(tmp_path))
    async with http_session() as session:
        status, body = await post(session, service, "sleep", "?level=1")
    assert status == 502, body
    assert body["failed_engines"] == [2]
    assert sim.llm.logger_manager.sleep_states == []
    assert sim.llm.renderer.mm_cache_clears == 0
