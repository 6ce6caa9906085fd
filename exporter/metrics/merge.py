"""Several processes' families as one set of series (vLLM with several API server processes).

With ``--api-server-count`` > 1, every API server process runs the in-process exporter (each is
a client of every engine), and a scrape of vLLM's ``/metrics`` reaches any one of them. So that
every scrape shows the same series, once, each process publishes its families
(``families_to_json``) and the one answering merges them as prometheus_client's multiprocess mode
does: gauges (what a poll saw) from the leader (API server 0) only, counters and histograms (what
happened) summed over every process, and the timestamps of what happened (a prefix-cache reset,
run by whichever process got the request) as the latest of every process. Pure functions; the
files are ``exporter.inprocess.shared``'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from exporter.metrics.catalog import BY_NAME
from exporter.metrics.families import Family

Labels = tuple[str, ...]
#: What one process's file may hold at most (families, rows): larger files are not read.
MAX_ROWS = 200_000


class BadShare(ValueError):
    """A process's published families that cannot be believed (the message says why)."""


def families_to_json(families: Sequence[Family]) -> bytes:
    doc = [
        {
            "name": fam.spec.name,
            "labels": list(fam.labels),
            "rows": [[list(values), value] for values, value in fam.rows],
            "histograms": [
                [list(values), [[le, count] for le, count in buckets], total]
                for values, buckets, total in fam.histograms
            ],
        }
        for fam in families
    ]
    return json.dumps(doc, separators=(",", ":")).encode()


def families_from_json(data: bytes) -> list[Family]:
    """The families another process published; ``BadShare`` for anything else (unknown
    names, label names not the catalog's, wrong shapes, a series or family twice, too many
    rows): what it returns renders as valid exposition text."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise BadShare(f"not JSON: {exc}") from None
    if not isinstance(doc, list):
        raise BadShare("not a list of families")
    families: list[Family] = []
    rows, names = 0, set[str]()
    for entry in doc:
        fam = _family(entry)
        rows += len(fam.rows) + len(fam.histograms)
        if rows > MAX_ROWS:
            raise BadShare(f"more than {MAX_ROWS} rows")
        if fam.spec.name in names:
            raise BadShare(f"{fam.spec.name} twice")
        names.add(fam.spec.name)
        families.append(fam)
    return families


def _family(entry: Any) -> Family:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise BadShare("a family without a name")
    spec = BY_NAME.get(entry["name"])
    if spec is None:
        raise BadShare(f"unknown family {entry['name']!r}")
    labels = _labels(entry.get("labels"))
    # The renderer writes label names as they are (the catalog's are valid by construction):
    # only the catalog's names, and model_name, are believed.
    if labels not in (spec.labels, (*spec.labels, "model_name")):
        raise BadShare(f"{spec.name}: label names {list(labels)!r} are not the catalog's")
    fam = Family(spec, labels)
    seen: set[Labels] = set()
    for row in _list(entry.get("rows")):
        if not (isinstance(row, list) and len(row) == 2):
            raise BadShare(f"{spec.name}: a row is not [labels, value]")
        fam.rows.append((_unique(spec.name, row[0], len(labels), seen), _number(row[1])))
    for hist in _list(entry.get("histograms")):
        if not (isinstance(hist, list) and len(hist) == 3):
            raise BadShare(f"{spec.name}: a histogram is not [labels, buckets, sum]")
        buckets = []
        for bucket in _list(hist[1]):
            if not (isinstance(bucket, list) and len(bucket) == 2 and isinstance(bucket[0], str)):
                raise BadShare(f"{spec.name}: a bucket is not [le, count]")
            buckets.append((bucket[0], _number(bucket[1])))
        if not buckets:
            raise BadShare(f"{spec.name}: a histogram without buckets")
        values = _unique(spec.name, hist[0], len(labels), seen)
        fam.histograms.append((values, buckets, _number(hist[2])))
    return fam


def _unique(name: str, value: Any, count: int, seen: set[Labels]) -> Labels:
    """Label values, once per family (a series twice fails the whole scrape)."""
    values = _values(value, count)
    if values in seen:
        raise BadShare(f"{name}: the series {list(values)!r} twice")
    seen.add(values)
    return values


def _list(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise BadShare("a list was expected")
    return value


def _labels(value: Any) -> Labels:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadShare("label names are not strings")
    return tuple(value)


def _values(value: Any, count: int) -> Labels:
    if not isinstance(value, list) or len(value) != count:
        raise BadShare("label values do not match the label names")
    if not all(isinstance(v, str) for v in value):
        raise BadShare("label values are not strings")
    return tuple(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadShare("a value is not a number")
    try:
        return float(value)
    except OverflowError:  # an integer beyond any float
        raise BadShare("a value is too large") from None


def merge_processes(leader: Sequence[Family], others: Sequence[Sequence[Family]]) -> list[Family]:
    """One set of families: gauges from ``leader``, counters and histograms summed over the
    leader and ``others`` (label sets only another process has are included), and the gauges
    of when something happened (``MetricSpec.latest``: a reset runs in whichever process got
    the request) as the latest of every process, and those of how long since
    (``MetricSpec.least``) as the least. Families keep the leader's order; a family
    only another process has is appended."""
    merged: dict[str, Family] = {}
    for fam in leader:
        copy = Family(fam.spec, fam.labels, list(fam.rows), list(fam.histograms))
        merged[fam.spec.name] = copy
    for families in others:
        for fam in families:
            if fam.spec.kind == "gauge" and not (fam.spec.latest or fam.spec.least):
                continue
            mine = merged.get(fam.spec.name)
            if mine is None:
                mine = merged[fam.spec.name] = Family(fam.spec, fam.labels)
            if mine.labels != fam.labels:
                continue  # another configuration (a model_name label): not summable
            if fam.spec.kind == "histogram":
                mine.histograms = _sum_histograms(mine.histograms, fam.histograms)
            elif fam.spec.kind == "gauge":
                pick = max if fam.spec.latest else min
                mine.rows = _extreme_rows(mine.rows, fam.rows, pick)
            else:
                mine.rows = _sum_rows(mine.rows, fam.rows)
    return list(merged.values())


def _sum_rows(
    a: Sequence[tuple[Labels, float]], b: Sequence[tuple[Labels, float]]
) -> list[tuple[Labels, float]]:
    totals: dict[Labels, float] = {}
    for values, value in (*a, *b):
        totals[values] = totals.get(values, 0.0) + value
    return sorted(totals.items())


def _extreme_rows(
    a: Sequence[tuple[Labels, float]],
    b: Sequence[tuple[Labels, float]],
    pick: Callable[[float, float], float],
) -> list[tuple[Labels, float]]:
    """Each label set's value picked over both (``max``: the latest; ``min``: the least)."""
    picked: dict[Labels, float] = {}
    for values, value in (*a, *b):
        picked[values] = pick(picked.get(values, value), value)
    return sorted(picked.items())


Histogram = tuple[Labels, list[tuple[str, float]], float]


def _sum_histograms(a: Sequence[Histogram], b: Sequence[Histogram]) -> list[Histogram]:
    totals: dict[Labels, tuple[dict[str, float], float]] = {}
    order: dict[Labels, list[str]] = {}
    for values, buckets, total in (*a, *b):
        counts, running = totals.get(values, ({}, 0.0))
        for le, count in buckets:
            if le not in counts:
                order.setdefault(values, []).append(le)
            counts[le] = counts.get(le, 0.0) + count
        totals[values] = (counts, running + total)
    return [
        (values, [(le, counts[le]) for le in order.get(values, [])], total)
        for values, (counts, total) in sorted(totals.items())
    ]
