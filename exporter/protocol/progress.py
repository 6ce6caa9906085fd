"""Forward progress per rank: the tokens it computed, as vLLM tells them (pure).

``has_work`` says whether a rank *should* step, not whether it *does*: a rank whose scheduler
holds requests it never schedules answers every call and looks healthy. What does not lie is
the tokens the rank computed, prompt plus generated. Two sources carry them:

- vLLM's stat loggers (in-process: each step's ``IterationStats`` per ``engine_idx``, recorded
  by the plugin's ``exporter.inprocess.statlogger``);
- vLLM's ``/metrics`` counters ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``,
  one series per ``engine`` label (HTTP mode: :func:`metrics_tokens`).

What is not progress: ``SchedulerStats.step_counter`` (0 in every stats object a stat logger
receives; only the MoE DP engine sets it, for its coordinator), and a call to ``record`` itself
(it runs for steps that computed nothing). A count is a whole number from 0 to
:data:`MAX_TOKENS`; anything else is unknown (``None``), never a guessed zero.
"""

from __future__ import annotations

from typing import Any

import msgspec

from exporter.protocol.activity import (
    MAX_RANKS,
    engine_samples,
    read_whole,
    sample_value,
)

#: The largest token count believed (a rank at a million tokens a second for 30 years).
MAX_TOKENS = 10**15
#: The ``/metrics`` counters that are a rank's computed tokens.
TOKEN_FAMILIES = frozenset({"vllm:prompt_tokens_total", "vllm:generation_tokens_total"})


class RankProgress(msgspec.Struct, frozen=True):
    """One rank's forward progress: the tokens it computed so far (as its source counts them),
    when the exporter last saw that count grow (unix; until it grows, when the exporter first
    read it), the source (``stat_logger`` or ``metrics``), and the requests whose tokens the
    source counts that the rank holds now (in-process: this API server's own unfinished
    requests on it; None: the source does not say), and since when it holds them without a
    break (the first read that saw them; None: it holds none, or the source does not say)."""

    tokens: int
    last_progress_unix: float
    source: str
    held: int | None = None
    held_since_unix: float | None = None

    def age_s(self, now_unix: float) -> float:
        """Seconds since the count last grew (never negative)."""
        return max(0.0, now_unix - self.last_progress_unix)

    def stall_age_s(self, now_unix: float) -> float:
        """Seconds the rank has held requests without computing a token: since the count last
        grew or since it got work, whichever came later (an idle rank's first request after a
        quiet hour is not an hour late)."""
        since = max(self.last_progress_unix, self.held_since_unix or 0.0)
        return max(0.0, now_unix - since)

    def json(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "last_progress_unix": self.last_progress_unix,
            "source": self.source,
            "held": self.held,
            "held_since_unix": self.held_since_unix,
        }


def read_tokens(value: Any) -> int | None:
    """A token count, or None when ``value`` is not one (``read_whole`` up to
    :data:`MAX_TOKENS`)."""
    return read_whole(value, MAX_TOKENS)


def metrics_tokens(text: str) -> dict[int, int | None] | None:
    """Rank → its computed tokens (prompt plus generated, every series of the rank summed:
    several API server processes each count the requests they sent) from vLLM's ``/metrics``;
    a rank with a sample that is not a count is None (unknown). None when neither counter is
    there (``--disable-log-stats``: unknown). Ranks past :data:`MAX_RANKS` are not read."""
    found: dict[int, int | None] = {}
    seen = False
    for _, rank, sample in engine_samples(text, TOKEN_FAMILIES, "vllm:"):
        seen = True
        if rank is None or (rank not in found and len(found) >= MAX_RANKS):
            continue
        value = sample_value(sample, MAX_TOKENS)
        previous = found.get(rank, 0)
        total = None if value is None or previous is None else previous + value
        found[rank] = total if total is not None and total <= MAX_TOKENS else None
    return found if seen else None


def total_tokens(text: str) -> int | None:
    """The tokens every rank of one API server's ``/metrics`` computed, or None when any rank's
    count cannot be read (a rank left out would make the sum look stalled)."""
    per_rank = metrics_tokens(text)
    if not per_rank or any(n is None for n in per_rank.values()):
        return None
    return sum(n for n in per_rank.values() if n is not None)


class ProgressClock:
    """When each key's token count last grew, from counts read now and then (HTTP mode reads
    them with every poll). A first read, or a count that went down (the rank or its API server
    restarted), starts the clock at that read."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._last: dict[str, RankProgress] = {}

    def observe(self, key: str, tokens: int, now_unix: float) -> RankProgress:
        previous = self._last.get(key)
        if previous is None or tokens != previous.tokens:
            progress = RankProgress(tokens, now_unix, self.source)
            self._last[key] = progress
            return progress
        return previous

    def forget(self, key: str) -> None:
        """``key``'s count is unknown now: the next read starts its clock again."""
        self._last.pop(key, None)
