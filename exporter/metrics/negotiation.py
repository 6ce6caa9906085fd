"""Content negotiation of ``GET /metrics``: which of the two formats served, gzip or not.

Only two formats exist: the Prometheus text format 0.0.4 (the default) and OpenMetrics 1.0.0.
Whatever the client sends, the answer is one of them, so nothing a client writes in ``Accept``
reaches a cache key or a response header. ``Accept`` ranges are weighed by their q-values, the
most specific range deciding a format's weight (RFC 9110 §12.5.1); an OpenMetrics range with
a version other than 1.x (``version=abc``, ``2.0.0``) does not match. When nothing acceptable
matches, the answer falls back to the text format (never 406: a scraper always gets metrics).
``Accept-Encoding`` is parsed with q-values too: ``gzip;q=0`` means no gzip.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import cast

from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

TEXT = "text"
OPENMETRICS = "openmetrics"
CONTENT_TYPES = {
    TEXT: "text/plain; version=0.0.4; charset=utf-8",
    OPENMETRICS: "application/openmetrics-text; version=1.0.0; charset=utf-8",
}
#: The OpenMetrics encoder (escaping "underscores", version 1.0.0, its defaults).
generate_openmetrics = cast(Callable[[CollectorRegistry], bytes], generate_latest)
#: Both negotiated headers: a cache must not give one client's variant to another.
VARY = "Accept, Accept-Encoding"

_OPENMETRICS_VERSION = re.compile(r"1(\.[0-9]+){0,2}")
#: Headers longer than aiohttp's line limit never get here; this only bounds the work.
_MAX_ITEMS = 64


def _qvalue(text: str) -> float | None:
    try:
        q = float(text)
    except ValueError:
        return None
    return q if math.isfinite(q) and 0.0 <= q <= 1.0 else None


def _items(header: str) -> list[tuple[str, dict[str, str]]]:
    """``a/b;k=v;q=0.5, ...`` → [(lowercased value, {lowercased key: value})]."""
    items = []
    for raw in header.split(",")[:_MAX_ITEMS]:
        value, *params = raw.split(";")
        value = value.strip().lower()
        if not value:
            continue
        parsed: dict[str, str] = {}
        for param in params:
            key, _, v = param.partition("=")
            parsed[key.strip().lower()] = v.strip().strip('"')
        items.append((value, parsed))
    return items


def _matches(media: str, params: dict[str, str], fmt: str) -> int:
    """How specifically ``media`` names ``fmt``: 0 not at all, 1 ``*/*``, 2 ``type/*``,
    3 the exact type."""
    if media == "*/*":
        return 1
    if fmt == TEXT:
        return {"text/plain": 3, "text/*": 2}.get(media, 0)
    if media == "application/*":
        return 2
    if media == "application/openmetrics-text":
        version = params.get("version")
        return 3 if version is None or _OPENMETRICS_VERSION.fullmatch(version) else 0
    return 0


def metrics_format(accept: str) -> str:
    """``TEXT`` or ``OPENMETRICS`` for an ``Accept`` header (TEXT when nothing fits)."""
    best: dict[str, tuple[int, float, int]] = {}  # fmt → (specificity, q, position)
    for position, (media, params) in enumerate(_items(accept)):
        q = _qvalue(params["q"]) if "q" in params else 1.0
        if q is None:
            continue
        for fmt in (TEXT, OPENMETRICS):
            specificity = _matches(media, params, fmt)
            if specificity and (fmt not in best or specificity > best[fmt][0]):
                best[fmt] = (specificity, q, position)
    acceptable = [(q, -position, fmt == TEXT, fmt) for fmt, (_, q, position) in best.items()]
    acceptable = [a for a in acceptable if a[0] > 0]
    if not acceptable:
        return TEXT
    # Highest q; then the range listed first; then the text format (``*/*`` alone).
    return max(acceptable)[3]


def wants_gzip(accept_encoding: str) -> bool:
    """True when ``Accept-Encoding`` gives gzip a q-value above 0 (explicitly, as ``x-gzip``,
    or through ``*``) that is not below identity's explicit q-value."""
    weights: dict[str, float] = {}
    for coding, params in _items(accept_encoding):
        q = _qvalue(params["q"]) if "q" in params else 1.0
        if q is not None:
            weights.setdefault("gzip" if coding == "x-gzip" else coding, q)
    gzip_q = weights.get("gzip", weights.get("*", 0.0))
    return gzip_q > 0 and gzip_q >= weights.get("identity", 0.0)
