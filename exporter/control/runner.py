"""``ActionRunner``: the one path every admin action takes once the admin listener let it
through: its spec's fan-out with its spec's timeout, then what every action leaves behind (its
counters, each engine's confirmed prefix-cache reset, the partial-failure warning, the last
action on /status) and the fresher state it calls for (the gate's shared sample dropped, a poll
soon)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from exporter.client.fleet import FleetClient
from exporter.config.settings import ServeConfig
from exporter.control.actions import ACTIONS, ActionRun, ActionSpec
from exporter.control.parsing import ActionRequest
from exporter.control.resets import confirmed_resets
from exporter.metrics.stats import Stats

log = logging.getLogger("exporter.admin")


@dataclass(frozen=True)
class ActionParts:
    """What an action takes of the running exporter, and nothing more: the fleet (counted),
    the counters, the settings, and the two ways to ask for fresher state afterwards."""

    fleet: FleetClient
    stats: Stats
    config: ServeConfig
    #: Drops the gate's shared sample (the next gate asks the engines after the action).
    invalidate_gate: Callable[[], None]
    #: Cuts the poller's wait short (the next poll publishes the action's effect).
    poll_soon: Callable[[], None]


class ActionRunner:
    """Runs parsed admin requests on the fleet of ``parts``."""

    def __init__(self, parts: ActionParts) -> None:
        self.parts = parts

    async def run(self, request: ActionRequest) -> ActionRun:
        spec = ACTIONS[request.action]
        parts = self.parts
        result = await spec.fanout(
            parts.fleet, request, timeout_s=spec.timeout(parts.config), shape=spec.answer
        )
        self._record(spec, result)
        self._record_resets(request, result)
        parts.stats.record_last_action(request.action, result.status, result.body)
        # The state may have changed: the gate's shared sample and the last poll are older.
        parts.invalidate_gate()
        parts.poll_soon()
        return result

    def _record_resets(self, request: ActionRequest, result: ActionRun) -> None:
        """Per engine, the prefix-cache reset the action confirmed (``exporter.control.resets``),
        stamped now: after the engine's answer, so never before the reset itself."""
        if result.verdict is None:
            return
        versions = {d.engine: d.vllm_version for d in self.parts.fleet.engine_details()}
        engines = confirmed_resets(request, result.verdict, versions)
        if engines:
            self.parts.stats.record_confirmed_resets(engines, request.action, time.time())

    def _record(self, spec: ActionSpec, result: ActionRun) -> None:
        stats = self.parts.stats
        verdict = result.verdict
        if verdict is None:  # no engine connected
            if spec.counts_as_reset:
                stats.record_reset("failure")
            stats.record_action(spec.name, "failure")
            return
        failures = [(e.engine, e.reason or "") for e in verdict.failures]
        if spec.counts_as_reset:
            success_unix = time.time() if verdict.success else None
            stats.record_reset(verdict.outcome, failures, result.duration_s, success_unix)
        if "mismatches" in result.extra:
            stats.record_weight_verification(result.extra["mismatches"])
        stats.record_action(spec.name, verdict.outcome, failures)
        if not verdict.success:
            log.warning(
                "%s %s: %s",
                spec.log_name or spec.name,
                verdict.outcome,
                ", ".join(f"engine {e.engine} {e.reason}" for e in verdict.failures),
            )
