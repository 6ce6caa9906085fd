"""A lean Prometheus text-format encoder for ``exporter.metrics.families.family_steps`` rows.

prometheus_client's ``generate_latest`` re-validates and re-escapes every metric and label name
of every sample; at 64+ engines that costs most of a scrape (docs/benchmarks/). Our names come
from the catalog and are valid by construction, so this encoder only escapes label values and
formats numbers. Its output is byte-identical to ``generate_latest`` on the same data
(tests/unit/metrics/test_exposition.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import cast

from prometheus_client.utils import floatToGoString

from exporter.base import steps
from exporter.base.steps import Steps
from exporter.metrics.families import Family

_float_to_go = cast(Callable[[float], str], floatToGoString)
#: Most values are 0 and 1 (gauges, one-hot states): skip the float formatting for them.
_COMMON = {0.0: "0.0", 1.0: "1.0"}


def _go(value: float) -> str:
    return _COMMON.get(value) or _float_to_go(value)


@functools.lru_cache(maxsize=4096)
def _escape(value: str) -> str:
    """Label values repeat on every scrape (engine indices, states, methods): escape once."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _label_writer(names: Sequence[str]) -> Callable[[Sequence[str]], str]:
    """``{a="..",b=".."}`` for label values given in ``names`` order; names sorted, as
    prometheus_client writes them. Specialised for the one- to three-label families that make
    up almost every row."""
    order = sorted(range(len(names)), key=names.__getitem__)
    keys = [f'{names[i]}="' for i in order]
    esc = _escape
    if not names:
        return lambda v: ""
    if len(names) == 1:
        (k0,), (i0,) = keys, order
        return lambda v: "{" + k0 + esc(v[i0]) + '"}'
    if len(names) == 2:
        (k0, k1), (i0, i1) = keys, order
        return lambda v: "{" + k0 + esc(v[i0]) + '",' + k1 + esc(v[i1]) + '"}'
    if len(names) == 3:
        (k0, k1, k2), (i0, i1, i2) = keys, order
        return lambda v: (
            "{" + k0 + esc(v[i0]) + '",' + k1 + esc(v[i1]) + '",' + k2 + esc(v[i2]) + '"}'
        )
    pairs = list(zip(keys, order, strict=True))
    return lambda v: "{" + '",'.join(k + esc(v[i]) for k, i in pairs) + '"}'


def text_steps(families: Sequence[Family]) -> Steps[bytes]:
    """The text exposition of ``families``, in steps of at most about ``SAMPLES_PER_STEP``
    samples (``exporter.base.steps``), each step's text encoded in that step (one body of
    256 engines' series encoded at once would be one long step); the families are not changed
    while it runs (``family_steps`` makes new ones)."""
    written: list[bytes] = []
    out: list[str] = []

    def full(lines: int) -> bool:
        """Whether ``lines`` more would overfill this step; then its text is encoded."""
        if not out or len(out) + lines <= steps.SAMPLES_PER_STEP:
            return False
        written.append("".join(out).encode("utf-8"))
        out.clear()
        return True

    for fam in families:
        spec = fam.spec
        name = spec.name  # counters already carry _total, as generate_latest writes them
        doc = spec.help.replace("\\", r"\\").replace("\n", r"\n")
        if full(1):
            yield
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {spec.kind}\n")
        if spec.kind == "histogram":
            labels = _label_writer(fam.labels)
            bucket_labels = _label_writer((*fam.labels, "le"))
            for values, buckets, total in fam.histograms:
                if full(len(buckets) + 2):
                    yield
                for le, count in buckets:
                    out.append(f"{name}_bucket{bucket_labels((*values, le))} {_go(count)}\n")
                plain = labels(values)
                out.append(f"{name}_count{plain} {_go(buckets[-1][1])}\n")
                out.append(f"{name}_sum{plain} {_go(total)}\n")
            continue
        labels = _label_writer(fam.labels)
        rows = fam.rows
        start = 0
        while start < len(rows):  # the rows fill what this step has left, then the next
            if full(1):
                yield
            end = start + steps.SAMPLES_PER_STEP - len(out)
            out.extend(
                f"{name}{labels(values)} {_go(value)}\n" for values, value in rows[start:end]
            )
            start = end
    written.append("".join(out).encode("utf-8"))
    return b"".join(written)
