"""vLLM 0.34's process-checkpoint lifecycle of one simulated engine (its rules read from
``EngineCore``/``DPEngineCoreProc`` of the 0.34 wheel): ``running`` → ``checkpoint_prepare``
→ ``preparing`` (its scheduler paused, draining) → ``prepared`` → ``checkpoint_restore`` →
``running``; a fault (``fail_with``) ends a prepare ``failed`` with that error. Sleep and
wake-up are refused outside ``running``."""

from __future__ import annotations

import re
from dataclasses import dataclass

RUNNING, PREPARING, PREPARED, RESTORING, FAILED = (
    "running",
    "preparing",
    "prepared",
    "restoring",
    "failed",
)


#: The first vLLM release with the lifecycle.
FIRST_RELEASE = (0, 34)


def has_lifecycle(vllm_version: str) -> bool:
    """Whether an engine of ``vllm_version`` (``"0.34.0"``, ``"0.34.0rc1"``) has it."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", vllm_version.split("+")[0])[:2])
    return numbers >= FIRST_RELEASE


@dataclass
class SimCheckpoint:
    """One engine's checkpoint state; ``ready_at`` is when a prepare's drain completes."""

    state: str = RUNNING
    error: str | None = None
    ready_at: float | None = None
    #: Fault: the next prepare ends ``failed`` with this error once drained.
    fail_with: str | None = None
    #: Registered with ``--enable-sleep-mode`` (vLLM prepares only then).
    sleep_mode: bool = True

    def answer(self) -> list[str | None]:
        """``checkpoint_state()``: ``(state, error)``, a list on the wire."""
        return [self.state, self.error]

    def start_prepare(self, now: float, drain_s: float) -> None:
        self.state, self.ready_at = PREPARING, now + drain_s

    def tick(self, now: float) -> None:
        """A prepare whose drain completed is ``prepared`` (or ``failed`` under the fault)."""
        if self.state == PREPARING and self.ready_at is not None and now >= self.ready_at:
            self.ready_at = None
            if self.fail_with is not None:
                self.state, self.error = FAILED, self.fail_with
            else:
                self.state = PREPARED

    def refusal(self, sleeping: bool) -> str | None:
        """Why ``checkpoint_prepare`` will not start (vLLM's texts), or None."""
        if self.state != RUNNING:
            return f"Cannot prepare while the checkpoint state is {self.state}"
        if not self.sleep_mode:
            return "Preparing for a checkpoint requires --enable-sleep-mode"
        if sleeping:
            return "Preparing for a checkpoint requires an awake engine"
        return None

    def guard(self, what: str, allowed: tuple[str, ...] = (RUNNING,)) -> None:
        """vLLM refuses a sleep outside ``running`` and a wake-up before ``restoring``."""
        if self.state not in allowed:
            raise ValueError(f"Cannot {what} while the checkpoint state is {self.state}")
