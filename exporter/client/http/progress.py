"""HTTP mode's progress: each dev-routes target's computed tokens from the ``/metrics`` answer
its ``has_work`` read fetched anyway (no request of its own), and when they last grew.

A dev-routes target is one engine to the exporter: its tokens are the sum over the ranks its
``/metrics`` names (``exporter.protocol.progress.total_tokens``: one unreadable rank makes the
sum unknown). A plugin-enabled target's ranks are not read here (unknown). Progress read this
way is shown, never a reason to call a rank stalled (``exporter.fleetstate.activity``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from exporter.client.http.target import PluginTargetState, TargetState
from exporter.client.observe import PROGRESS, Observation
from exporter.protocol.progress import ProgressClock, total_tokens

#: Where HTTP mode's progress comes from (``RankProgress.source``): vLLM's ``/metrics`` counters.
METRICS = "metrics"


class ProgressReads:
    """When each target's computed tokens last grew, from its ``/metrics`` answers."""

    def __init__(self) -> None:
        self._clock = ProgressClock(METRICS)

    def read(self, state: TargetState, metrics: bytes | None) -> None:
        """``state``'s progress from the ``/metrics`` answer just read (None: the read failed:
        unknown, and its clock starts again with the next answer)."""
        label = state.target.label
        tokens = None if metrics is None else total_tokens(metrics.decode("utf-8", "replace"))
        if tokens is None:
            state.progress = None
            self._clock.forget(label)
            return
        state.progress = self._clock.observe(label, tokens, time.time())

    @staticmethod
    def observations(states: Iterable[TargetState]) -> list[Observation]:
        """Each dev-routes target's progress as its last ``/metrics`` read found it."""
        return [
            Observation(
                s.target.label, PROGRESS, s.progress, s.progress.last_progress_unix, METRICS
            )
            for s in states
            if s.progress is not None and not isinstance(s, PluginTargetState)
        ]
