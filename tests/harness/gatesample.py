"""A gate ``Sample`` from plain values, for the gate's pure verdict (``evaluate``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.gate import Sample
from exporter.protocol.pushes import FaultStatus


def gate_sample(
    values: Mapping[str, Mapping[str, Any]],
    fault_status: Mapping[str, FaultStatus] | None = None,
) -> Sample:
    """engine → method → value (an OK answer) or an ``EngineOutcome`` as it is."""
    outcomes: dict[str, dict[str, EngineOutcome]] = {}
    for engine, per_method in values.items():
        for method, value in per_method.items():
            o = (
                value
                if isinstance(value, EngineOutcome)
                else EngineOutcome(engine, Outcome.OK, value)
            )
            outcomes.setdefault(method, {})[engine] = o
    return Sample(outcomes, tuple(values), 0.0, 0.0, fault_status)
