"""What in-process mode reads of vLLM besides its engine-core client, each with a fallback.

Only this module and ``exporter.client.inprocess.vllm_core`` name vLLM's attributes; nothing
here imports vLLM at module level (a trainer's process has it, the exporter's tests do not).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

from exporter.client.inprocess.vllm_core import VllmCore, engine_core_of
from exporter.error import ConfigError


def vllm_version() -> str | None:
    try:
        vllm = importlib.import_module("vllm")
    except ImportError:
        return None
    version = getattr(vllm, "__version__", None)
    return str(version) if version is not None else None


def _attr(obj: Any, *names: str) -> Any:
    for name in names:
        obj = getattr(obj, name, None)
        if obj is None:
            return None
    return obj


def sleep_mode(engine_client: Any) -> bool | None:
    """``--enable-sleep-mode`` of the engines (the same for every engine of one client)."""
    value = _attr(engine_client, "vllm_config", "model_config", "enable_sleep_mode")
    return bool(value) if isinstance(value, bool) else None


@dataclass(frozen=True)
class ApiServer:
    """Which of vLLM's API server processes this is, and how many there are."""

    index: int
    count: int

    @property
    def leader(self) -> bool:
        return self.index == 0


def api_server(engine_client: Any, args: Namespace | None) -> ApiServer:
    """vLLM's ``parallel_config._api_process_rank/_count`` (0.32, 0.33); else the client's
    ``client_index`` and ``--api-server-count``; else one API server."""
    parallel = _attr(engine_client, "vllm_config", "parallel_config")
    count = getattr(parallel, "_api_process_count", None)
    index = getattr(parallel, "_api_process_rank", None)
    if not isinstance(count, int) or count < 1:
        from_args = getattr(args, "api_server_count", None) if args is not None else None
        count = from_args if isinstance(from_args, int) and from_args >= 1 else 1
    if not isinstance(index, int) or index < 0:
        index = int(getattr(getattr(engine_client, "engine_core", None), "client_index", 0))
    return ApiServer(index=index, count=count)


def multiprocess_dir() -> str | None:
    """prometheus_client's multiprocess directory, which vLLM sets with several API servers."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def check_loop(engine_client: Any) -> None:
    """vLLM's client answers only on the event loop that created it: refuse any other loop."""
    handler = getattr(engine_client, "output_handler", None)
    if not isinstance(handler, asyncio.Task) or handler.done():
        return
    if handler.get_loop() is not asyncio.get_running_loop():
        raise ConfigError(
            "in-process mode must start in the event loop that runs the AsyncLLM "
            "(its output handler runs on another loop)"
        )


#: vLLM's API server middleware, which keeps the process-local elastic-EP flag.
SCALING_MODULE = "vllm.entrypoints.serve.elastic_ep.middleware"


def scaling_flag() -> bool:
    """vLLM's process-local elastic-EP flag (``get_scaling_elastic_ep``), what its route
    answers without external elastic EP. Read from the module only where this process loaded
    it (vLLM's API server does): the flag is set only through that module, so a process that
    never loaded it is not scaling, and nothing is imported on vLLM's event loop."""
    module = sys.modules.get(SCALING_MODULE)
    getter = getattr(module, "get_scaling_elastic_ep", None)
    return bool(getter()) if callable(getter) else False


def core_of(engine_client: Any) -> VllmCore:
    """The engine-core client of ``engine_client`` as in-process mode uses it, with what
    vLLM says about itself (version, sleep mode)."""
    check_loop(engine_client)
    return VllmCore(
        engine_core_of(engine_client),
        vllm_version=vllm_version(),
        enable_sleep_mode=sleep_mode(engine_client),
        front_end=engine_client,
        scaling_flag=scaling_flag,
    )
