"""vLLM stat-logger plugin ``dp_exporter`` (entry-point group ``vllm.stat_logger_plugins``).

vLLM (0.32 to 0.34) loads every class of that group when it builds an engine client, in each
API server process, and calls its ``record(scheduler_stats, iteration_stats, mm_cache_stats,
engine_idx)`` on its output path for every step whose outputs reached this process. This one
hands the step's computed tokens to the process's ``ProgressFeed`` and does nothing else: it
never raises (an exception there fails vLLM's output handler, and with it every request), and
it does nothing while no exporter runs in the process. ``VLLM_PLUGINS`` selects it by the same
name as the endpoint plugin, so ``VLLM_PLUGINS=dp_exporter`` loads both or neither.

vLLM checks that a stat-logger plugin subclasses its ``StatLoggerBase``, so the class is built
on vLLM's own base, found when vLLM imports this module (``logger_class``: tests build it on a
stand-in base, without vLLM).
"""

from __future__ import annotations

import importlib
from typing import Any

from exporter.client.inprocess.feed import FEED, ProgressFeed


def logger_class(base: type, feed: ProgressFeed = FEED) -> type:
    """The stat logger on ``base`` (vLLM's ``AggregateStatLoggerBase``: one logger for every
    engine index of the client), recording into ``feed``."""

    def __init__(self: Any, vllm_config: Any, engine_indexes: Any = None) -> None:
        feed.attach(engine_indexes if engine_indexes is not None else (0,))

    def record(
        self: Any,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: Any = 0,
    ) -> None:
        feed.record(engine_idx, iteration_stats)

    def log_engine_initialized(self: Any) -> None:
        pass

    return type(
        "DpProgressLogger",
        (base,),
        {
            "__init__": __init__,
            "record": record,
            "log_engine_initialized": log_engine_initialized,
            "__doc__": "Each step's computed tokens, per engine, for the dp_exporter plugin.",
            "__module__": __name__,
        },
    )


def _vllm_base() -> type:
    loggers = importlib.import_module("vllm.v1.metrics.loggers")
    base: type = loggers.AggregateStatLoggerBase
    return base


def __getattr__(name: str) -> Any:
    """``DpProgressLogger``, built on vLLM's base when vLLM asks for it (importing this module
    does not import vLLM: the exporter's own tests and tools import it without one)."""
    if name == "DpProgressLogger":
        cls = logger_class(_vllm_base())
        globals()[name] = cls
        return cls
    raise AttributeError(name)
