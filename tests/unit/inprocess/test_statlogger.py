"""The stat-logger plugin (``exporter.inprocess.statlogger``) as vLLM uses it: a class on
vLLM's own base (a stand-in here, with vLLM's abstract methods), built once per engine client
with its engine indexes, whose ``record`` vLLM calls on its output path for every step."""

from __future__ import annotations

import abc
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from exporter.client.inprocess.feed import ProgressFeed
from exporter.inprocess import statlogger
from exporter.inprocess.statlogger import logger_class


class StandInBase(abc.ABC):
    """vLLM's ``AggregateStatLoggerBase``: what a subclass must implement."""

    @abc.abstractmethod
    def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None: ...

    @abc.abstractmethod
    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None: ...

    @abc.abstractmethod
    def log_engine_initialized(self) -> None: ...

    def log(self) -> None:
        return None


@dataclass
class Stats:
    num_generation_tokens: Any = 0
    num_prompt_tokens: Any = 0


def test_vllm_builds_it_on_its_base_and_each_record_reaches_the_feed() -> None:
    feed = ProgressFeed(clock=lambda: 7.0)
    cls = logger_class(StandInBase, feed)
    assert issubclass(cls, StandInBase) and cls.__name__ == "DpProgressLogger"
    logger = cls(vllm_config=object(), engine_indexes=[0, 1])  # not abstract any more
    assert feed.attached == frozenset({0, 1})
    feed.start()
    logger.record(scheduler_stats=None, iteration_stats=Stats(3, 4), engine_idx=1)
    logger.record(None, Stats("hostile"), None, 0)  # never raises
    logger.log_engine_initialized()
    logger.log()
    progress = feed.progress([0, 1]) or {}
    assert (progress[0].tokens, progress[1].tokens) == (0, 7)
    assert feed.hostile == 1


def test_importing_the_module_imports_no_vllm() -> None:
    # ``vllm`` made unimportable: a module-level import of it would fail the import here (and
    # this machine's own environment has no vLLM to notice it otherwise).
    code = (
        "import sys; sys.modules['vllm'] = None; import exporter.inprocess.statlogger as m; "
        "assert callable(m.logger_class); print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr


def test_the_class_vllm_loads_is_built_on_vllms_base_when_asked_for() -> None:
    if importlib.util.find_spec("vllm") is None:
        # Without vLLM, asking for it fails as an import (vLLM logs a plugin it cannot load).
        with pytest.raises(ImportError):
            statlogger.DpProgressLogger  # noqa: B018
        return
    base = statlogger._vllm_base()
    assert issubclass(statlogger.DpProgressLogger, base)
