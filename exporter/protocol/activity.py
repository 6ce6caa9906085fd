"""What a rank is doing, as vLLM publishes it: its running and waiting request counts (pure).

Three sources carry them, each decoded here so one rule bounds them all:

- the DP coordinator's per-engine load-balancing counts, ``[waiting, running, ...]`` per rank
  (what vLLM's front end routes by: ``lb_engines``; in-process mode reads the front end's copy,
  relay mode subscribes to the coordinator's publication itself: ``decode_coordinator_stats``);
- vLLM's ``/metrics`` (``vllm:num_requests_running`` / ``vllm:num_requests_waiting``, one series
  per ``engine`` label; HTTP mode);
- a plugin-enabled server's ``/dp/gate`` (``activity`` of each rank; HTTP mode over a plugin).

A count is a whole number from 0 to :data:`MAX_REQUESTS`; anything else (negative, huge, NaN, a
string, a bool) makes the pair unknown (``None``), never a guessed zero: "drained" is a claim a
trainer syncs weights on.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterator
from typing import Any

import msgspec

from exporter.error import ProtocolError

#: The largest request count believed (vLLM's own bound is the scheduler's queue: far below).
MAX_REQUESTS = 10_000_000
#: The ``/metrics`` families per-rank counts are read from, and the state each one is.
METRIC_STATES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
#: Longest ``/metrics`` line looked at (a longer one is skipped, never parsed).
MAX_METRICS_LINE = 4096
#: Most ranks one answer or publication is read for (the exporter's own scale bound).
MAX_RANKS = 1024
_ENGINE_LABEL = re.compile(r'(?:^|,)\s*engine="([0-9]{1,6})"')


class RequestCounts(msgspec.Struct, frozen=True):
    """One rank's requests: ``running`` (scheduled) and ``waiting`` (queued, e.g. behind a
    paused scheduler)."""

    running: int
    waiting: int

    @property
    def total(self) -> int:
        return self.running + self.waiting

    def json(self) -> dict[str, int]:
        return {"running": self.running, "waiting": self.waiting}


def counts_text(counts: RequestCounts | None) -> str:
    """``" (running 1, waiting 0)"`` for failure texts, or "" when the counts are not known."""
    return "" if counts is None else f" (running {counts.running}, waiting {counts.waiting})"


def read_whole(value: Any, maximum: int) -> int | None:
    """A whole number from 0 to ``maximum`` (an int, or a float with no fraction), or None for
    anything else: bools, NaN, infinities, negatives, fractions, strings, past ``maximum``.
    The one rule every count a peer sends is read by (requests, tokens)."""
    if type(value) is int:  # the common case first: in-process reads 256 ranks many a poll
        return value if 0 <= value <= maximum else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    return value if 0 <= value <= maximum else None


def read_count(value: Any) -> int | None:
    """A request count, or None when ``value`` is not one (``read_whole`` up to
    :data:`MAX_REQUESTS`)."""
    return read_whole(value, MAX_REQUESTS)


def read_counts(running: Any, waiting: Any) -> RequestCounts | None:
    """Both counts, or None when either is not a count."""
    r, w = read_count(running), read_count(waiting)
    return None if r is None or w is None else RequestCounts(r, w)


def read_lb_entry(entry: Any) -> RequestCounts | None:
    """One rank of vLLM's load-balancing counts: ``[waiting, running]`` (0.20, 0.26) or
    ``[waiting, running, kv_cache_usage]`` (0.30, 0.32); None when it is not such a list."""
    if not isinstance(entry, (list, tuple)) or not 2 <= len(entry) <= 8:
        return None
    return read_counts(entry[1], entry[0])


#: The longest coordinator publication decoded (vLLM's is ~20 bytes per rank).
MAX_COORDINATOR_MESSAGE = 64 << 10


def decode_coordinator_stats(payload: bytes) -> list[RequestCounts | None] | None:
    """One publication of vLLM's DP coordinator to its front ends, ``(counts, wave, running)``
    msgpack-encoded (``DPCoordinatorProc``; docs/protocol.md socket 6): each rank's counts by
    its position (a rank whose entry is not two counts is None: unknown), or None when this
    publication carries no counts. ``ProtocolError`` when it is not such a message."""
    if len(payload) > MAX_COORDINATOR_MESSAGE:
        raise ProtocolError("bad_coordinator_stats", f"{len(payload)} bytes")
    try:
        message = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        raise ProtocolError("bad_coordinator_stats", "not msgpack") from None
    if not isinstance(message, list) or len(message) != 3:
        raise ProtocolError("bad_coordinator_stats", "not (counts, wave, running)")
    counts = message[0]
    if counts is None:
        return None
    if not isinstance(counts, list) or len(counts) > MAX_RANKS:
        raise ProtocolError("bad_coordinator_stats", "counts are not a list of ranks")
    return [read_lb_entry(entry) for entry in counts]


def read_activity_json(value: Any) -> RequestCounts | None:
    """A ``{"running": n, "waiting": n}`` object (``/status``, a plugin's ``/dp/gate``)."""
    if not isinstance(value, dict):
        return None
    return read_counts(value.get("running"), value.get("waiting"))


def engine_samples(
    text: str, families: Collection[str], prefix: str
) -> Iterator[tuple[str, int | None, str]]:
    """Each line of vLLM's ``/metrics`` exposition of one of ``families`` that carries labels:
    (family, the rank its ``engine`` label names, or None when it names none readable, the text
    after the labels). Only lines starting with ``prefix`` and at most ``MAX_METRICS_LINE``
    long are looked at (a longer one is skipped, never parsed); one pass, no regex over the
    whole body."""
    for line in text.splitlines():
        if not line.startswith(prefix) or len(line) > MAX_METRICS_LINE:
            continue
        name, brace, rest = line.partition("{")
        if name not in families or not brace:
            continue
        labels, close, sample = rest.partition("}")
        match = _ENGINE_LABEL.search(labels) if close else None
        yield name, (int(match.group(1)) if match else None), sample


def sample_value(sample: str, maximum: int) -> int | None:
    """One ``/metrics`` sample's value (the text after its labels) as a whole number up to
    ``maximum`` (``read_whole``), or None when it is not one."""
    fields = sample.split()
    try:
        return read_whole(float(fields[0]), maximum) if fields else None
    except ValueError:
        return None


def metrics_counts(text: str) -> dict[int, RequestCounts] | None:
    """Per-rank counts from vLLM's ``/metrics`` exposition: engine index → counts, for every
    rank with both series. None when the answer has neither family at all (a vLLM run with
    ``--disable-log-stats``: unknown, not idle); a rank with any sample that is not a count is
    left out (unknown: each sample is checked before the rank's samples are summed), as is a
    rank that has only one of the two."""
    found: dict[str, dict[int, int | None]] = {"running": {}, "waiting": {}}
    seen = False
    for name, rank, sample in engine_samples(text, METRIC_STATES, "vllm:num_requests_"):
        seen = True
        if rank is None:
            continue
        per_state = found[METRIC_STATES[name]]
        if rank not in per_state and len(per_state) >= MAX_RANKS:
            continue
        value = sample_value(sample, MAX_REQUESTS)
        # Two API-server processes (or model names) may each publish a rank's series: their
        # sum is the rank's, of samples each checked first (3 and -3 are no idle 0).
        previous = per_state.get(rank, 0)
        per_state[rank] = None if value is None or previous is None else previous + value
    if not seen:
        return None
    counts = {}
    for rank in found["running"].keys() & found["waiting"].keys():
        pair = read_counts(found["running"][rank], found["waiting"][rank])
        if pair is not None:
            counts[rank] = pair
    return counts


def total_counts(counts: dict[int, RequestCounts]) -> RequestCounts:
    """The sum over ranks (one API server's requests)."""
    return RequestCounts(
        sum(c.running for c in counts.values()), sum(c.waiting for c in counts.values())
    )
