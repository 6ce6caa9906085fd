"""An ``Exporter`` over an in-memory ``FakeFleet`` of N engines, for socket-free benchmarks."""

from __future__ import annotations

from typing import Any

from exporter.client.fake import FakeFleet, Handler
from exporter.config.settings import resolve_config
from exporter.control.runtime import Exporter


async def polled_exporter(n: int, handler: Handler, **settings: Any) -> Exporter:
    """An owner-mode ``Exporter`` whose client is ``FakeFleet(handler)`` over engines 0..n-1,
    after one poll."""
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=n,
        handshake_address="tcp://127.0.0.1:1",
        admin_listen="off",
        **settings,
    )
    exporter = Exporter(config, client=FakeFleet(handler, engines=[str(i) for i in range(n)]))
    await exporter.poller.poll_once()
    return exporter
