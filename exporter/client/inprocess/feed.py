"""What vLLM's stat loggers tell the in-process exporter: each rank's computed tokens, and when.

vLLM hands every stat-logger plugin, for every engine step whose outputs its front end
processed, that batch's ``IterationStats`` with the engine's index (``record``, on vLLM's
output path: ``exporter.inprocess.statlogger``). ``ProgressFeed.record`` is the one thing that
path does: O(1), one small record per rank kept and updated in place, nothing at all while no
exporter runs in this process, and it never raises (a monitor must not stop vLLM's output
handler, whose failure fails every request). A value that is not a token count is counted
(``hostile``) and changes nothing.

With several API server processes, each step's outputs (and stats) reach the front end that
sent the request: each process's feed counts the tokens of its own requests, and the API
servers' share sums them (``exporter.metrics.merge``), as vLLM's own per-engine counters do.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from exporter.protocol.progress import MAX_TOKENS, RankProgress

SOURCE = "stat_logger"
#: Most engine indexes kept (the exporter's own scale bound); others are counted hostile.
MAX_ENGINES = 1024


class ProgressFeed:
    """Per engine index: ``[tokens, when they last grew]``, kept while ``active``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.active = False
        #: When this feed started counting (a rank with no record computed nothing since).
        self.started_unix = 0.0
        #: The engine indexes vLLM built the plugin's stat logger for (None: vLLM built none
        #: in this process, e.g. ``VLLM_PLUGINS`` leaves it out: no feed, progress unknown).
        self.attached: frozenset[int] | None = None
        self._records: dict[int, list[float]] = {}
        #: Per engine index: since when this process has seen it hold its requests (first
        #: read with a held count above 0; dropped at a read with none).
        self._held_since: dict[int, float] = {}
        #: Records refused (an index or a count that is not one).
        self.hostile = 0
        #: Records taken (each a step's stats that reached this process).
        self.records = 0

    def attach(self, engine_indexes: Any) -> None:
        """vLLM built the stat logger for ``engine_indexes`` (its ``StatLoggerManager``, when
        it creates the engine client: before the exporter starts)."""
        try:
            self.attached = frozenset(i for i in engine_indexes if type(i) is int)
        except TypeError:
            self.attached = frozenset()

    def detach(self) -> None:
        """No stat logger of ours any more (tests; vLLM never drops one it built)."""
        self.attached = None

    def start(self) -> None:
        """An exporter runs in this process from now on: records count."""
        self._records.clear()
        self._held_since.clear()
        self.started_unix = self._clock()
        self.active = True

    def stop(self) -> None:
        self.active = False
        self._records.clear()
        self._held_since.clear()

    def record(self, engine_idx: Any, iteration_stats: Any) -> None:
        """One step's stats of engine ``engine_idx``. Never raises."""
        if not self.active or iteration_stats is None:
            return
        try:
            self._record(engine_idx, iteration_stats)
        except Exception:  # never on vLLM's output path
            self.hostile += 1

    def _record(self, engine_idx: Any, stats: Any) -> None:
        if type(engine_idx) is not int or not 0 <= engine_idx < 1 << 20:
            self.hostile += 1
            return
        generated = _count(getattr(stats, "num_generation_tokens", None))
        prompt = _count(getattr(stats, "num_prompt_tokens", None))
        if generated is None or prompt is None:
            self.hostile += 1
            return
        record = self._records.get(engine_idx)
        if record is None:
            if len(self._records) >= MAX_ENGINES:
                self.hostile += 1
                return
            record = self._records[engine_idx] = [0, self.started_unix]
        self.records += 1
        computed = generated + prompt
        if computed and record[0] + computed <= MAX_TOKENS:
            record[0] += computed
            record[1] = self._clock()

    def progress(
        self, engines: list[int], held: Mapping[int, int | None] | None = None
    ) -> dict[int, RankProgress] | None:
        """Engine index → its progress, for each of ``engines`` vLLM built the stat logger for
        (one no step's stats came from computed nothing since the feed started); None while
        the feed is not active or vLLM built no stat logger of ours: unknown, never idle.
        ``held``: each rank's unfinished requests of this process (the ones it counts); a rank
        seen holding some carries since when (the stall clock starts there at the earliest)."""
        if not self.active or self.attached is None:
            return None
        now = self._clock()
        found = {}
        for engine in engines:
            if engine not in self.attached:
                continue
            record = self._records.get(engine)
            tokens, since = (0, self.started_unix) if record is None else record
            own = (held or {}).get(engine)
            held_since = None
            if own:
                held_since = self._held_since.setdefault(engine, now)
            else:
                self._held_since.pop(engine, None)
            found[engine] = RankProgress(int(tokens), since, SOURCE, own, held_since)
        return found


def _count(value: Any) -> int | None:
    """A step's token count: an ``int`` (never a bool or a float) within bounds, else None."""
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else None


#: The process's feed: vLLM builds the stat logger, the in-process exporter reads the feed.
FEED = ProgressFeed()
