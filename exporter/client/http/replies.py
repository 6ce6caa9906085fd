"""Pure mapping of one vLLM dev/RL-route reply to one ``EngineOutcome`` (protocol doc F.4).

An API server whose own engines disagree answers HTTP 500 "Engines returned different
is_sleeping results: [False, True]" (a Python list repr; ``GET /is_paused`` wraps it as
``{"error": "Failed to fetch pause status: Engines returned different is_scheduler_paused
results: [...]"}``): that target becomes ``INCONSISTENT`` carrying those values. 404 on
``/is_sleeping`` or ``/reset_prefix_cache`` means dev mode is off; 404 on any other route means
the server lacks it (an older vLLM, or dev mode off): ``FAILED`` with :data:`UNSUPPORTED_HINT`
in the error. An empty 200 from a reset means a vLLM older than 0.26 (no ``success`` field).

The value of an OK outcome is what the engine-core utility method returns (D): ``None`` for
``sleep``, ``pause_scheduler``, ``resume_scheduler``, ``set_weight_version`` and the cache
resets; ``wake_up``'s fully-awake bool; the version (or ``None``); for
``compute_weight_checksums`` a list of ``{key: digest}`` maps, one per worker (the route's merged
map split again by the keys' ``dp..:pp..:pcp..:tp..:ep..:`` rank prefix).

Every string of a reply (error texts, values, the values of an inconsistent answer) is cut by the
rule owner and relay mode apply to engine replies, ``exporter.protocol.strings``.

``has_work`` has no route of its own: it is read from vLLM's ``GET /metrics``
(``read_activity``): the target's running and waiting requests, summed over the ranks (``engine``
labels) the server publishes, and ``has_work`` true when they add up above zero. It fails closed:
an answer without either family (vLLM with ``--disable-log-stats``) is unsupported
(:data:`NOT_PUBLISHED`), never idle; one where any rank's series cannot be read (not a count, no
``engine`` label, one of the two missing) is ``FAILED`` without counts.

``fault_entries`` reads vLLM 0.33's ``GET /fault_tolerance/status`` (not a utility method: its
result is each rank's fault-tolerance status, ``EngineDetail.fault_status``; a target that is one
engine to the exporter gets the worst of its ranks, ``worst_fault_status``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.client.http.checkpoint import CHECKPOINT_METHODS, interpret_checkpoint
from exporter.client.http.consensus import MAX_INCONSISTENT_VALUES as MAX_INCONSISTENT_VALUES
from exporter.client.http.consensus import parse_inconsistent as parse_inconsistent
from exporter.protocol.activity import (
    MAX_RANKS,
    METRIC_STATES,
    RequestCounts,
    metrics_counts,
    total_counts,
)
from exporter.protocol.pushes import (
    FT_HEALTHY,
    FT_OTHER,
    FT_UNKNOWN,
    MAX_FAULT_INFO,
    RankStatus,
    entry_rank,
    read_rank_status,
)
from exporter.protocol.strings import bound_text, bound_value

DEV_MODE_OFF = "dev mode is off on this server (set VLLM_SERVER_DEV_MODE=1)"
NO_SUCCESS_FIELD = "server did not report success (vLLM older than 0.26?)"
#: In the error of a method whose route answered 404: the API server does not have it (a vLLM
#: without the route, or dev mode off). Callers treat it as "unsupported", like the engine's
#: "'EngineCoreProc' object has no attribute '<method>'".
UNSUPPORTED_HINT = "route not found on this server"
#: Methods whose 404 means dev mode is off (their routes exist in every supported vLLM).
DEV_MODE_METHODS = frozenset({"is_sleeping", "reset_prefix_cache"})
_RANK_PREFIX = re.compile(r"^(?:(?:dp|pp|pcp|tp|ep)\d+:)+")


def _error_message(body: bytes) -> str | None:
    """vLLM's error envelope ``{"error": {"message": ...}}`` or FastAPI's ``{"detail": ...}``;
    None for a body of another shape (deep nesting included: one linear C parse of a body
    the read limit already bounds)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        detail = data.get("detail")
        if detail is not None:
            return detail if isinstance(detail, str) else json.dumps(detail)
    return None


def rank_prefix(key: str) -> str:
    """The ``dp0:pp0:pcp0:tp0:ep0:`` rank prefix of a weight-checksum key ("" if none)."""
    m = _RANK_PREFIX.match(key)
    return m.group(0) if m else ""


def split_checksums(checksums: dict[str, str]) -> list[dict[str, str]]:
    """A merged ``/weight_checker`` map → one map per worker (rank prefix), first-seen order."""
    workers: dict[str, dict[str, str]] = {}
    for key, digest in checksums.items():
        workers.setdefault(rank_prefix(key), {})[key] = digest
    return list(workers.values())


def unsupported_error(method: str) -> str:
    if method == "has_work":  # vLLM serves /metrics without dev mode
        return f"{UNSUPPORTED_HINT}: has_work (no GET /metrics)"
    return f"{UNSUPPORTED_HINT}: {method} (a vLLM without this route, or dev mode off)"


class Unreadable(Exception):
    """A 200 answer without what its route promises; the message is the outcome's error."""


#: One route's 200 answer (its body) → the utility method's value; ``Unreadable`` when the
#: answer does not say it.
Decoder = Callable[[bytes], Any]


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise Unreadable(f"response is not JSON: {_snippet(body)}") from None
    except RecursionError:  # nested past the decoder: one linear parse, then refused
        raise Unreadable("response is nested too deeply to be an answer") from None


def _field(body: bytes, key: str, missing: str | None = None) -> Any:
    """The value of ``key`` in a JSON object answer; an empty answer or one without the key is
    ``Unreadable`` (``missing`` the error, else one naming what is missing)."""
    if not body.strip():
        raise Unreadable(missing or "empty response body")
    data = _json(body)
    if not isinstance(data, dict) or key not in data:
        raise Unreadable(missing or f"response has no {key!r}: {_snippet(body)}")
    return data[key]


def _nothing(body: bytes) -> None:
    """The utility returns None: the route's body only echoes the request."""
    return None


def _reader(key: str) -> Decoder:
    """A read route: the value is the answer's ``key``."""
    return lambda body: _field(body, key)


def _reset(body: bytes) -> Any:
    """``POST /reset_prefix_cache``: ``success`` (an empty 200: vLLM older than 0.26)."""
    return _field(body, "success", NO_SUCCESS_FIELD)


def _wake_up(body: bytes) -> bool | None:
    """``POST /wake_up``: whether the engine is fully awake (None: an older vLLM, whose answer
    is empty or has no ``status``)."""
    if not body.strip():
        return None
    data = _json(body)
    if not isinstance(data, dict) or "status" not in data:
        return None
    return bool(data["status"] == "awake")


def _checksums(body: bytes) -> list[dict[str, str]]:
    """``/weight_checker``: the merged map split again into one map per worker."""
    value = _field(body, "checksums")
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise Unreadable(f"checksums are not a map of strings: {_snippet(body)}")
    return split_checksums(value)


#: In the error of ``has_work`` from a ``/metrics`` without either request family (vLLM with
#: ``--disable-log-stats``): the server does not publish its requests, so ``has_work`` is
#: unsupported there (``exporter.fleetstate.invariants.UNSUPPORTED_MARKERS``), never idle.
NOT_PUBLISHED = "not published by this server"
#: ``[0-9]``, not ``\d``: ranks are ASCII digits only (``\d`` takes U+0661; ``int()`` reads 1).
_ENGINE_LABEL = re.compile(r'(?:^|,)\s*engine="([0-9]{1,6})"')


def _series_ranks(text: str) -> set[int | None]:
    """The rank each ``vllm:num_requests_{running,waiting}`` series names (None: one names no
    rank), stopping past ``MAX_RANKS`` ranks (more than any answer is read for)."""
    ranks: set[int | None] = set()
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name = re.split(r"[{\s]", line, maxsplit=1)[0]
        if name not in METRIC_STATES:
            continue
        labels, brace, _ = line[len(name) :].partition("}")
        match = _ENGINE_LABEL.search(labels.lstrip("{")) if brace else None
        ranks.add(int(match.group(1)) if match else None)
        if len(ranks) > MAX_RANKS:
            break
    return ranks


def activity_counts(body: bytes) -> RequestCounts:
    """``GET /metrics``'s 200 answer → the target's requests (the sum over its ranks);
    ``Unreadable`` when it does not publish them (:data:`NOT_PUBLISHED`) or any of its ranks
    cannot be read (a rank left out would make the sum a false "idle")."""
    text = body.decode("utf-8", "replace")
    named = _series_ranks(text)
    if not named:
        raise Unreadable(
            f"request counts {NOT_PUBLISHED} (no vllm:num_requests_running or "
            "vllm:num_requests_waiting in /metrics: vLLM with --disable-log-stats?)"
        )
    per_rank = metrics_counts(text) or {}
    unread = named - per_rank.keys()
    if None in unread:
        raise Unreadable("a request-count series in /metrics names no engine: counts unknown")
    if unread or not per_rank:
        shown = sorted(r for r in unread if r is not None)[:8]
        which = f"rank(s) {', '.join(map(str, shown))}" if shown else "any rank"
        raise Unreadable(f"request counts of {which} in /metrics cannot be read: unknown")
    return total_counts(per_rank)


def _has_work(body: bytes) -> bool:
    return activity_counts(body).total > 0


#: Each method's route → how its 200 answer is read (a method not named here: the answer's key
#: of the method's own name).
DECODERS: dict[str, Decoder] = {
    **dict.fromkeys(
        (
            "sleep",
            "pause_scheduler",
            "resume_scheduler",
            "set_weight_version",
            "reset_mm_cache",
            "reset_encoder_cache",
        ),
        _nothing,
    ),
    "is_sleeping": _reader("is_sleeping"),
    "is_scheduler_paused": _reader("is_paused"),
    "get_weight_version": _reader("weight_version"),
    "reset_prefix_cache": _reset,
    "wake_up": _wake_up,
    "compute_weight_checksums": _checksums,
    "has_work": _has_work,
}


def interpret(
    label: str, method: str, status: int, body: bytes, duration_s: float | None
) -> EngineOutcome:
    """Pure: one HTTP reply of a dev or RL route → one ``EngineOutcome`` (F.4, F.4.1): the
    failures every route shares here, a 200 answer read by the route's decoder."""

    def failed(error: str) -> EngineOutcome:
        return EngineOutcome(label, Outcome.FAILED, error=bound_text(error), duration_s=duration_s)

    if status == 404:
        return failed(DEV_MODE_OFF if method in DEV_MODE_METHODS else unsupported_error(method))
    if method in CHECKPOINT_METHODS:  # each state has its own status, the state in the body
        read = interpret_checkpoint(label, method, status, body, duration_s)
        if read is not None:
            return read
    message = _error_message(body)
    if status == 500 and message is not None:
        values = parse_inconsistent(message, method)
        if values is not None:
            return EngineOutcome(
                label,
                Outcome.INCONSISTENT,
                error=bound_text(message),
                duration_s=duration_s,
                values=values,
            )
        return failed(message)
    if status != 200:
        return failed(f"HTTP {status}: {message if message is not None else _snippet(body)}")
    decode = DECODERS.get(method) or _reader(method)
    try:
        value = decode(body)
    except Unreadable as exc:
        return failed(str(exc))
    return EngineOutcome(label, Outcome.OK, bound_value(value), duration_s=duration_s)


def read_activity(
    label: str, status: int, body: bytes, duration_s: float | None
) -> tuple[EngineOutcome, RequestCounts | None]:
    """Pure: one ``GET /metrics`` reply → the ``has_work`` outcome (``interpret``'s) and the
    target's requests (None unless the outcome is OK)."""
    if status != 200:
        return interpret(label, "has_work", status, body, duration_s), None
    try:
        counts = activity_counts(body)
    except Unreadable as exc:
        error = bound_text(str(exc))
        return EngineOutcome(label, Outcome.FAILED, error=error, duration_s=duration_s), None
    return EngineOutcome(label, Outcome.OK, counts.total > 0, duration_s=duration_s), counts


def _snippet(body: bytes) -> str:
    return bound_text(body.decode("utf-8", "replace").strip()) or "(empty body)"


#: ``GET /fault_tolerance/status``: the answer read at most (vLLM's is ~60 bytes per rank; a
#: longer one is refused unread, never buffered whole) and the ranks one answer may name.
MAX_FT_ANSWER = 1 << 20
MAX_FT_RANKS = 1024
#: Worst last: a server read as one engine reports its worst rank (unknown is never healthy).
#: ``paused`` (vLLM PR #41438: a rank held still, itself fine, while the fleet recovers) is the
#: least bad, then ``recovering`` (on its way back), then vLLM 0.34's ``diagnosing`` (faulted,
#: its mask being read: ``unhealthy`` next); ``unhealthy`` waits for an operator's
#: instruction; ``other`` (a status this exporter does not know) and ``unknown`` (one it could
#: not read) may hide anything, so they outrank every known recoverable status; ``dead``, known
#: beyond recovery in place, is the worst. Every value of ``FT_STATE_VALUES`` is ranked.
#: (A status outside it, which ``read_rank_status`` never gives, ranks as ``unknown``.)
_FT_WORST_LAST = (
    FT_HEALTHY,
    "paused",
    "recovering",
    "diagnosing",
    "unhealthy",
    FT_OTHER,
    FT_UNKNOWN,
    "dead",
)
_FT_SEVERITY = {status: rank for rank, status in enumerate(_FT_WORST_LAST)}


def fault_entries(body: bytes) -> list[RankStatus]:
    """Pure: every rank's status from vLLM 0.33's 200 answer ``{"schema_version": 1,
    "total_engines": N, "engines": [{"id": rank, "status": .., "fault_info": ..}, ..]}``, in
    rank order, each read by the one rule (``read_rank_status``: an unreadable status is
    ``unknown`` with its ``problem``). ``ValueError`` when the answer as a whole cannot be read
    (not JSON, no list, an entry naming no rank, a rank twice): the caller then knows no rank's
    status (the rank it garbles might be the faulty one: never a false healthy)."""
    if len(body) > MAX_FT_ANSWER:
        raise ValueError(f"answer longer than {MAX_FT_ANSWER} bytes")
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        raise ValueError(
            f"answer is not JSON (or nested too deeply): {_snippet(body[:64])}"
        ) from None
    entries = doc.get("engines") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or len(entries) > MAX_FT_RANKS:
        raise ValueError(f"answer has no list of at most {MAX_FT_RANKS} engines")
    ranks = []
    for entry in entries:
        rank = entry_rank(entry)
        if rank is None:
            raise ValueError("an entry names no rank")
        ranks.append(read_rank_status(entry, rank))
    ranks.sort(key=lambda r: r.rank)
    if len({r.rank for r in ranks}) != len(ranks):
        raise ValueError("answer names a rank twice")
    return ranks


def worst_fault_status(ranks: list[RankStatus]) -> tuple[str, str | None] | None:
    """Pure: one server's (status, fault_info) over its ranks: the worst status, fault_info
    naming the ranks that are not healthy (``"rank 1: RuntimeError"``, cut). None: no rank
    named."""
    if not ranks:
        return None
    unknown = _FT_SEVERITY[FT_UNKNOWN]
    worst = max((r.status for r in ranks), key=lambda s: _FT_SEVERITY.get(s, unknown))
    faulty = [f"rank {r.rank}: {r.fault_info or r.status}" for r in ranks if r.status != FT_HEALTHY]
    return worst, bound_text("; ".join(faulty), MAX_FAULT_INFO) if faulty else None
