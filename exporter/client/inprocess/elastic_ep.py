"""In-process mode's elastic-EP read: what vLLM's own ``POST /is_scaling_elastic_ep`` answers,
read in vLLM's process once a poll.

``await engine_client.get_external_elastic_ep_status()`` (vLLM 0.33, ``VllmCore.
elastic_ep_status``; vLLM reads its shared store in a thread), in a task of its own started at
the poll's start and never awaited by the poll's reads, bounded by the call timeout, one at a
time; any exception is this read's ``problem`` (vLLM's route answers 503 then), never raised
into vLLM. A status map is read by the one rule (``read_status``); None (no external elastic
EP) is the process-local flag as vLLM's route reads it (``committing`` while set, else
``idle``; ``VllmCore.scaling_flag``; no flag in this process: ``idle``). A vLLM without the
method (0.32) is unsupported here: no series, not asked again. The one target is this process's
API server (``LOCAL_TARGET``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from exporter.client.inprocess.vllm_core import ELASTIC_EP_STATUS, VllmCore
from exporter.protocol.elastic_ep import (
    ElasticEpOperation,
    ElasticEpRead,
    UnreadableAnswer,
    read_status,
)
from exporter.protocol.strings import bound_text

log = logging.getLogger("exporter.inprocess")

#: The ``target`` label of in-process mode's one API server: the process the exporter runs in.
LOCAL_TARGET = "local"
UNSUPPORTED = (
    f"unsupported here: vLLM's engine client has no {ELASTIC_EP_STATUS} (vLLM older than 0.33)"
)


class ElasticEpWatch:
    """This process's read (``refresh`` starts one, ``reads`` says what the last one found)."""

    def __init__(
        self,
        core: VllmCore,
        label: str = LOCAL_TARGET,
        *,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._core = core
        self._label = label
        self._wall = wall
        self._last = ElasticEpRead(label)
        self._task: asyncio.Task[None] | None = None

    def reads(self) -> tuple[ElasticEpRead, ...]:
        return (self._last,)

    def refresh(self, timeout_s: float) -> None:
        if self._task is not None and not self._task.done():
            return  # the last one still waits (vLLM's store read runs in a thread)
        if not self._last.supported:
            return  # the method does not come back within one vLLM process
        self._task = asyncio.create_task(self._read(timeout_s))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _read(self, timeout_s: float) -> None:
        try:
            ask = self._core.elastic_ep_status()
        except Exception as exc:  # an engine client of another shape: nothing to ask
            self._set(problem=f"not read: {type(exc).__name__}")
            return
        if ask is None:
            self._last = ElasticEpRead(
                self._label, problem=UNSUPPORTED, read_at_unix=self._wall(), supported=False
            )
            return
        try:
            status = await asyncio.wait_for(_call(ask), timeout_s)
        except asyncio.TimeoutError:
            self._set(problem=f"no answer from {ELASTIC_EP_STATUS}() within {timeout_s:g}s")
            return
        except Exception as exc:  # vLLM's route answers 503 "temporarily unavailable" here
            text = bound_text(f"{type(exc).__name__}: {exc}")
            self._set(problem=f"temporarily unavailable: {text}")
            return
        try:
            operation = self._flag_operation() if status is None else read_status(status)
        except UnreadableAnswer as exc:
            self._set(problem=f"unreadable status from {ELASTIC_EP_STATUS}(): {exc}")
            return
        self._set(operation=operation)

    def _flag_operation(self) -> ElasticEpOperation:
        """No external elastic EP: the process-local flag, as vLLM's route reads it."""
        flag = self._core.scaling_flag
        try:
            scaling = bool(flag()) if flag is not None else False
        except Exception as exc:
            raise UnreadableAnswer(f"the process-local flag: {type(exc).__name__}") from None
        return read_status({"is_scaling_elastic_ep": scaling})

    def _set(self, operation: ElasticEpOperation | None = None, problem: str | None = None) -> None:
        if problem is not None:
            log.debug("elastic-EP status not read: %s", problem)
        self._last = ElasticEpRead(self._label, operation, problem, read_at_unix=self._wall())


async def _call(ask: Callable[[], Any]) -> Any:
    return await ask()
