"""Helpers shared by the test suites: bounded waiting and reading a scrape."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

WAIT_S = 10.0


async def eventually(
    predicate: Callable[[], bool],
    timeout_s: float = WAIT_S,
    what: str = "condition",
    step_s: float = 0.01,
) -> None:
    """Wait (bounded) until ``predicate()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(step_s)


def parse_metrics(text: str) -> dict[str, Any]:
    """Family name → family (prometheus_client's parser; counters lose their ``_total``)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: dict[str, Any], family: str, **labels: str) -> list[Any]:
    """The samples of one family whose labels include ``labels``."""
    if family.endswith("_total"):
        family = family[: -len("_total")]
    f = families.get(family)
    if f is None:
        return []
    return [
        s
        for s in f.samples
        if s.name in (family, f"{family}_total") and labels.items() <= s.labels.items()
    ]


def metric_value(families: dict[str, Any], family: str, **labels: str) -> float | None:
    """The value of the one sample matching ``labels`` (None when absent)."""
    found = samples(families, family, **labels)
    assert len(found) <= 1, f"{family}{labels} matches {len(found)} samples"
    return found[0].value if found else None
