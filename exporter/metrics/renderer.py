"""The exporter's series as bytes, rendered once per state change: one renderer, one cache.

The service's ``/metrics`` (text or OpenMetrics, gzip or not, with the process's own series)
and the plugin's ``vllm_dp_*`` text (appended to vLLM's own series, which has the process's)
are forms of one render. Each form's body is kept with the state version it was made from
(``version``: every change a scrape could show bumps it), so a storm of scrapes costs one
render, not one per scrape, and a cached body is never older than the state. The cache holds
one entry per form: at most five, whatever clients send.
"""

from __future__ import annotations

import gzip
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from exporter.base.steps import Steps
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import ExporterCollector
from exporter.metrics.negotiation import CONTENT_TYPES, TEXT, generate_openmetrics

GZIP_LEVEL = 5


@dataclass(frozen=True)
class Form:
    """One form of the series: the exposition format, gzip or not, and whether the process's
    own ``process_*`` / ``python_*`` series follow (the service's; vLLM has its own)."""

    fmt: str = TEXT
    use_gzip: bool = False
    process: bool = True

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.fmt]


#: The plugin's form: this exporter's series alone, as text, appended to vLLM's own.
OURS = Form(TEXT, use_gzip=False, process=False)


class Renderer:
    """Renders ``collector``'s families in every ``Form``, each cached on ``version()``."""

    def __init__(
        self,
        collector: ExporterCollector,
        process_registry: CollectorRegistry,
        openmetrics_registry: CollectorRegistry,
        version: Callable[[], Hashable],
    ) -> None:
        self._collector = collector
        self._process = process_registry
        self._openmetrics = openmetrics_registry
        self._version = version
        self._cache: dict[Form, tuple[Hashable, bytes]] = {}

    @property
    def entries(self) -> int:
        """How many forms are kept (one per form ever asked for)."""
        return len(self._cache)

    def cached(self, form: Form) -> tuple[Hashable, bytes] | None:
        """``form``'s kept body and the state version it was made from (None: none kept)."""
        return self._cache.get(form)

    def forget(self) -> None:
        """Drop every kept body: the next ask renders afresh (as after a state change)."""
        self._cache.clear()

    def steps(self, form: Form) -> Steps[bytes]:
        """``form``'s body in steps: the cached one while the state is unchanged."""
        version = self._version()
        cached = self._cache.get(form)
        if cached is not None and cached[0] == version:
            return cached[1]
        body = yield from self._render(form)
        if form.use_gzip:
            body = gzip.compress(body, compresslevel=GZIP_LEVEL)
        self._cache[form] = (version, body)
        return body

    def _render(self, form: Form) -> Steps[bytes]:
        if form.fmt != TEXT:
            # OpenMetrics has the process's series in its one registry (one # EOF).
            yield
            return generate_openmetrics(self._openmetrics)
        families = yield from self._collector.family_steps()
        body = yield from text_steps(families)
        # process_* change by themselves: rendered with each new body, so they are as
        # fresh as the exporter's own state (at most one poll old).
        return body + generate_latest(self._process) if form.process else body
