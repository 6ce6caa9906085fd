"""``vllm-dp-exporter probe``: own the handshake of N engines, run the aggregated calls once.

Prints one JSON object and exits 0 (all calls succeeded, engines agreed), 3 (engines
disagree), 2 (a reset was refused by some engine) or 1 (any other error); 1 wins over 3, 3 over 2.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from exporter.base.faults import ProtocolErrorTally
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.client.owner import OwnerConfig, OwnerTransport, owner_client
from exporter.control.parsing import ActionRequest, reset_request
from exporter.control.verdicts import classify
from exporter.error import HandshakeError
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.fleetstate.invariants import SLEEPING, require_type

EXIT_OK, EXIT_ERROR, EXIT_PARTIAL_RESET, EXIT_INCONSISTENT = 0, 1, 2, 3
#: ``probe_report`` judges only the reset's outcomes: its flags do not change the verdict.
PROBE_RESET: ActionRequest = reset_request(False, False)


@dataclass
class ProbeOptions:
    owner: OwnerConfig
    ready_timeout_s: float = 60.0
    call_timeout_s: float = 10.0
    reset_prefix_cache: bool = False
    reset_running_requests: bool = False
    reset_connector: bool = False


def outcome_json(o: EngineOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {"outcome": o.outcome.value}
    if o.outcome is Outcome.OK:
        entry["value"] = o.value
    if o.error is not None:
        entry["error"] = o.error
    if o.values:
        entry["values"] = list(o.values)
    return entry


def probe_report(
    sleeping: list[EngineOutcome], reset: list[EngineOutcome] | None, handshake_error: str | None
) -> tuple[dict[str, Any], int, str]:
    """Pure: build the JSON report, the exit code and the stderr line from the outcomes."""
    sleeping = require_type(SLEEPING, sleeping)
    verdict = aggregate_consensus("is_sleeping", sleeping)
    consistent = {
        FleetState.CONSISTENT: True,
        FleetState.INCONSISTENT: False,
        FleetState.UNKNOWN: None,
    }[verdict.state]
    report: dict[str, Any] = {
        "is_sleeping": {
            "value": verdict.value if verdict.state is FleetState.CONSISTENT else None,
            "consistent": consistent,
            "engines": {o.engine: outcome_json(o) for o in sleeping},
        }
    }
    messages: list[tuple[int, str]] = []
    if handshake_error:
        report["error"] = handshake_error
        messages.append((EXIT_ERROR, handshake_error))
    not_ok = [o for o in sleeping if not o.ok]
    if not_ok:
        desc = ", ".join(f"engine {o.engine} {o.outcome.value}" for o in not_ok)
        messages.append((EXIT_ERROR, f"is_sleeping: {desc}"))
    if verdict.state is FleetState.INCONSISTENT and verdict.error is not None:
        messages.append((EXIT_INCONSISTENT, str(verdict.error)))
    if reset is not None:
        # The admin action's verdict: the AND of every engine's own True, reasons per engine.
        reset_verdict = classify(PROBE_RESET, reset)
        engines: dict[str, Any] = {}
        for e in reset_verdict.engines:
            entry: dict[str, Any] = {"ok": e.reason is None}
            if e.reason is not None:
                entry["reason"] = e.reason
                if e.error:
                    entry["error"] = e.error
            engines[e.engine] = entry
        report["reset_prefix_cache"] = {"success": reset_verdict.success, "engines": engines}
        if not reset_verdict.engines:
            messages.append((EXIT_ERROR, "reset_prefix_cache: no engine to call"))
        for f in reset_verdict.failures:
            code = EXIT_PARTIAL_RESET if f.reason == "refused" else EXIT_ERROR
            messages.append((code, f"reset_prefix_cache: engine {f.engine} {f.reason}"))
    if not messages:
        return report, EXIT_OK, ""
    rank = {EXIT_ERROR: 0, EXIT_INCONSISTENT: 1, EXIT_PARTIAL_RESET: 2}
    code = min((c for c, _ in messages), key=rank.__getitem__)
    return report, code, "; ".join(m for c, m in messages if c == code)


async def run_probe(options: ProbeOptions) -> int:
    errors = ProtocolErrorTally()
    client = owner_client(options.owner, errors)
    transport = client.transport
    assert isinstance(transport, OwnerTransport)
    await client.start()
    try:
        handshake_error = None
        try:
            await transport.wait_connected(options.ready_timeout_s)
        except HandshakeError as exc:
            handshake_error = str(exc)
        sleeping = await client.call_utility("is_sleeping", timeout_s=options.call_timeout_s)
        reset = None
        if options.reset_prefix_cache:
            request = reset_request(options.reset_running_requests, options.reset_connector)
            reset = await client.call_utility(
                request.method, request.args, timeout_s=options.call_timeout_s
            )
    finally:
        await client.close()
    report, code, message = probe_report(sleeping, reset, handshake_error)
    print(json.dumps(report), flush=True)
    if code:
        print(f"vllm-dp-exporter probe: {message}", file=sys.stderr)
    return code
