"""vLLM endpoint plugin ``dp_exporter`` (entry-point group ``vllm.endpoint_plugins``).

``pip install vllm-dp-exporter`` into vLLM's environment and start vLLM with
``VLLM_PLUGINS=dp_exporter``: each API server process polls every DP engine through its own
engine-core client and serves ``/dp/...`` and the ``vllm_dp_*`` series on vLLM's port
(``exporter.inprocess.routes``). Without the allow-list entry vLLM never imports this module.

vLLM calls ``attach_router(app)`` while it builds the app and ``init_state(engine_client,
state, args)`` once its state is ready, both in its event loop; an exception from either would
stop vLLM, so neither raises (``InProcessRuntime.start``). vLLM has no shutdown hook for
plugins: the exporter stops when the app's lifespan ends.
"""

from __future__ import annotations

import contextlib
import logging
from argparse import Namespace
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from exporter.inprocess.routes import add_routes
from exporter.inprocess.runtime import InProcessRuntime

log = logging.getLogger("exporter.inprocess")

PLUGIN_NAME = "dp_exporter"


def vllm_metrics_renderer() -> Callable[[], bytes]:
    """vLLM's own ``/metrics`` body, rendered as vLLM renders it (its registry; a fresh
    multiprocess collector per scrape when ``PROMETHEUS_MULTIPROC_DIR`` is set)."""
    import os

    from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, multiprocess

    def render() -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            return generate_latest(registry)
        return generate_latest(REGISTRY)

    return render


class DpExporterPlugin:
    """The ``EndpointPlugin`` (vLLM's protocol: ``name``, ``required_tasks``, two hooks)."""

    name = PLUGIN_NAME
    #: Every server that has engines: generation, pooling and the rest alike.
    required_tasks: tuple[str, ...] | None = None

    def __init__(self, runtime: InProcessRuntime | None = None) -> None:
        self.runtime = runtime if runtime is not None else InProcessRuntime()

    def attach_router(self, app: FastAPI) -> None:
        add_routes(app, self.runtime, vllm_metrics_renderer())
        self._stop_with_lifespan(app)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        await self.runtime.start(engine_client, args)

    def _stop_with_lifespan(self, app: FastAPI) -> None:
        """Stop the exporter when vLLM's app shuts down (its lifespan context ends)."""
        inner = app.router.lifespan_context
        runtime = self.runtime

        @contextlib.asynccontextmanager
        async def lifespan(application: Any) -> AsyncIterator[Any]:
            async with inner(application) as state:
                try:
                    yield state
                finally:
                    await runtime.stop()

        app.router.lifespan_context = lifespan
