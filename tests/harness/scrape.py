"""Reading a scrape with prometheus_client's parser."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Families = dict[str, Any]


def parse_metrics(text: str) -> Families:
    """Family name → family (prometheus_client's parser; counters lose their ``_total``)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(families: Families, family: str, **labels: str) -> list[Sample]:
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


def metric_value(families: Families, family: str, **labels: str) -> float | None:
    """The value of the one sample matching ``labels`` (None when absent)."""
    found = samples(families, family, **labels)
    assert len(found) <= 1, f"{family}{labels} matches {len(found)} samples"
    return found[0].value if found else None
