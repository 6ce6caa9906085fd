"""``ActionRunner``: the one path every admin action takes once the admin listener let it
through: its spec's fan-out with its spec's timeout, then what every action leaves behind (its
counters, each engine's confirmed prefix-cache reset, the partial-failure warning, the last
action on /status) and the fresher state it calls for (the gate's shared sample dropped, a poll
soon)."""

from __future__ import annotations

import logging
import time

from exporter.control.actions import ACTIONS, ActionRun, ActionSpec
from exporter.control.parsing import ActionRequest
from exporter.control.resets import confirmed_resets
from exporter.control.runtime import Exporter

log = logging.getLogger("exporter.admin")


class ActionRunner:
    """Runs parsed admin requests on ``exporter``'s fleet."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter

    async def run(self, request: ActionRequest) -> ActionRun:
        spec = ACTIONS[request.action]
        exporter = self.exporter
        result = await spec.fanout(
            exporter.fleet, request, timeout_s=spec.timeout(exporter.config), shape=spec.answer
        )
        self._record(spec, result)
        self._record_resets(request, result)
        exporter.stats.record_last_action(request.action, result.status, result.body)
        # The state may have changed: the gate's shared sample and the last poll are older.
        exporter.gate.invalidate()
        exporter.poller.poll_soon()
        return result

    def _record_resets(self, request: ActionRequest, result: ActionRun) -> None:
        """Per engine, the prefix-cache reset the action confirmed (``exporter.control.resets``),
        stamped now: after the engine's answer, so never before the reset itself."""
        if result.verdict is None:
            return
        versions = {d.engine: d.vllm_version for d in self.exporter.fleet.engine_details()}
        engines = confirmed_resets(request, result.verdict, versions)
        if engines:
            self.exporter.stats.record_confirmed_resets(engines, request.action, time.time())

    def _record(self, spec: ActionSpec, result: ActionRun) -> None:
        stats = self.exporter.stats
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
