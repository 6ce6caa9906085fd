"""``wait``: ask the gate until every engine meets the conditions, or the timeout passes.

The last step of an RL loop before rollouts resume. Which failures are retried follows from
what they mean: a gate that is closed (412), no engine connected yet (503), an exporter that
is restarting (``Unreachable``) or answering garbage for a moment (5xx, an unreadable answer)
may all change within the timeout, so the check runs again every ``interval_s``; a question
the gate rejects (400: a bad condition; 404: no gate at that URL; 401: wrong credentials; any
other 4xx) cannot, and neither can a condition no engine supports (501, ``Unsupported``), so
those raise at once instead of burning the timeout.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from exporter.remote.answers import UNSUPPORTED_STATUS, printable
from exporter.remote.errors import BadRequest, RemoteError, WaitTimeout
from exporter.remote.results import GateResult

#: Longest single gate request (the gate bounds its own fan-out by its --call-timeout).
REQUEST_TIMEOUT_S = 30.0
#: Shortest single gate request, even when the wait's time is nearly up.
MIN_REQUEST_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class Progress:
    """One check that did not open the gate, handed to the ``progress`` callback."""

    #: 1 for the first check.
    attempt: int
    elapsed_s: float
    remaining_s: float
    #: The gate's answer (closed), or None when the check failed (``error`` says why).
    result: GateResult | None
    error: RemoteError | None

    @property
    def summary(self) -> str:
        """One printable line: what still fails, or why the gate could not be asked."""
        if self.result is None:
            return printable(self.error) if self.error is not None else "no answer"
        failing = [
            f"engine {printable(e.engine)}: {printable('; '.join(e.failures) or 'failing')}"
            for e in self.result.failing
        ]
        return " | ".join(failing) or printable(self.result.error or f"HTTP {self.result.status}")


#: Called after every check that did not open the gate; may return an awaitable (awaited).
#: An exception raised by it ends the wait with that exception.
ProgressCallback = Callable[[Progress], Any]
#: One gate check with a per-request timeout in seconds.
Check = Callable[[float], Awaitable[GateResult]]


#: The gate's condition on each rank's work (``drained=true|false``).
DRAINED = "drained"


def with_drained(conditions: Mapping[str, Any] | None, drained: bool | None) -> dict[str, Any]:
    """``conditions`` plus ``drained`` (None: not asked). ``BadRequest`` (before anything is
    sent) when ``drained`` is not a boolean or contradicts a ``drained`` in ``conditions``."""
    wanted = dict(conditions or {})
    if drained is None:
        return wanted
    if not isinstance(drained, bool):
        raise BadRequest(f"drained must be True, False or None, got {printable(repr(drained))}")
    if DRAINED in wanted and query({DRAINED: wanted[DRAINED]}) != query({DRAINED: drained}):
        raise BadRequest(
            f"drained={drained} contradicts the conditions' "
            f"drained={printable(repr(wanted[DRAINED]))}"
        )
    wanted[DRAINED] = drained
    return wanted


#: The gate's condition on each rank's vLLM 0.34 checkpoint state, and what it may ask.
CHECKPOINT = "checkpoint"
CheckpointGoal = Literal["prepared", "running"]
CHECKPOINT_GOALS: tuple[CheckpointGoal, ...] = ("prepared", "running")


def with_checkpoint(conditions: Mapping[str, Any], checkpoint: str | None) -> dict[str, Any]:
    """``conditions`` plus ``checkpoint`` (None: not asked). ``BadRequest`` (before anything
    is sent, so a wait never burns its timeout on a typo) for a state the gate does not wait
    on, or one that contradicts a ``checkpoint`` in ``conditions``."""
    wanted = dict(conditions)
    if checkpoint is None:
        return wanted
    if checkpoint not in CHECKPOINT_GOALS:
        raise BadRequest(
            f"checkpoint must be 'prepared' or 'running', got {printable(repr(checkpoint))}"
        )
    if CHECKPOINT in wanted and wanted[CHECKPOINT] != checkpoint:
        raise BadRequest(
            f"checkpoint={checkpoint} contradicts the conditions' "
            f"checkpoint={printable(repr(wanted[CHECKPOINT]))}"
        )
    wanted[CHECKPOINT] = checkpoint
    return wanted


def query(conditions: Mapping[str, Any]) -> dict[str, str]:
    """The gate's query parameters: booleans as ``true``/``false``."""
    return {
        name: (str(value).lower() if isinstance(value, bool) else str(value))
        for name, value in conditions.items()
    }


def describe(conditions: Mapping[str, Any]) -> str:
    return " ".join(f"{printable(k)}={printable(v)}" for k, v in query(conditions).items()) or (
        "(none)"
    )


def retried(exc: RemoteError) -> bool:
    """Whether a failed check may succeed later (see the module's docstring)."""
    status = exc.status
    if status == UNSUPPORTED_STATUS:  # no engine can answer the question: it never will
        return False
    return status is None or not 400 <= status < 500 or status == 412


def last_error_of(exc: RemoteError) -> str:
    """How a failed check is named in the timeout's message: ``HTTP 500`` for an answer the
    exporter sent as JSON, the whole line otherwise (``ClientConnectorError: ...``)."""
    if exc.body is not None and exc.status is not None:
        return f"HTTP {exc.status}"
    return str(exc)


async def wait_for_gate(
    check: Check,
    conditions: Mapping[str, Any],
    timeout_s: float,
    *,
    interval_s: float = 1.0,
    progress: ProgressCallback | None = None,
    request_timeout_s: float = REQUEST_TIMEOUT_S,
    clock: Callable[[], float] = time.monotonic,
) -> GateResult:
    """The gate's first open answer; ``WaitTimeout`` (with the last answer) once
    ``timeout_s`` passed; the error of a rejected question at once."""
    if not interval_s > 0 or not timeout_s >= 0:
        raise ValueError("interval_s must be positive and timeout_s not negative")
    started = clock()
    deadline = started + timeout_s
    last: GateResult | None = None
    last_error = "no answer yet"
    attempt = 0
    while True:
        attempt += 1
        remaining = deadline - clock()
        error: RemoteError | None = None
        result: GateResult | None = None
        try:
            result = await check(max(MIN_REQUEST_TIMEOUT_S, min(request_timeout_s, remaining)))
        except RemoteError as exc:
            if not retried(exc):
                raise
            error, last_error = exc, last_error_of(exc)
        else:
            if result.ok:
                return result
            last, last_error = result, f"HTTP {result.status}"
        if progress is not None:
            now = clock()
            done = progress(
                Progress(attempt, now - started, max(0.0, deadline - now), result, error)
            )
            if inspect.isawaitable(done):
                await done
        if deadline - clock() <= 0:
            break
        await asyncio.sleep(min(interval_s, max(0.0, deadline - clock())))
    raise WaitTimeout(
        f"wait timed out after {timeout_s:g}s for {describe(conditions)} (last: {last_error})",
        last=last,
        last_error=last_error,
        status=last.status if last is not None else None,
        body=last.raw if last is not None else None,
    )
