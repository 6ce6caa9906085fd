"""Fixtures of the fault-injection suite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from tests.resilience.support import Service, make_config, start_service

ServiceFactory = Callable[..., Awaitable[Service]]


@pytest.fixture
async def service_factory() -> AsyncIterator[ServiceFactory]:
    """``await service_factory(n, **config)`` → a running ``Service`` (engines not started)."""
    made: list[Service] = []

    async def build(engine_count: int = 2, *, guarded: bool = False, **overrides: Any) -> Service:
        service = await start_service(make_config(engine_count, **overrides), guarded=guarded)
        made.append(service)
        return service

    yield build
    for service in reversed(made):
        await asyncio.wait_for(service.stop(), 15)
