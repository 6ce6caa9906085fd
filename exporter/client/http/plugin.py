"""HTTP mode over plugin-enabled vLLM servers: per-engine answers from each server's ``/dp/gate``.

A target whose URL ends in ``/dp`` (``--http-target a=http://10.0.0.5:8000/dp``) is a vLLM API
server running the ``dp_exporter`` endpoint plugin. Its engines are read one by one: one
``GET <url>/gate`` per poll (a fresh fan-out inside that server, shared by the poll's read
methods) answers every engine's ``sleeping``, ``paused``, ``weight_version`` and ``has_work``,
and each engine becomes one engine of this exporter, labelled ``<target>/<rank>`` — so one
sidecar can watch many plugin-enabled servers with per-engine truth. Admin actions are not
relayed to such a target (each server runs them per engine on its own ``POST
/dp/admin/<action>``): their outcome is ``failed`` with that hint, and nothing is sent. Each
rank's fault-tolerance status comes from vLLM's own route at the server's root
(``server_root``; ``exporter.client.http.fault``).

``has_work`` is the server's own ``has_work`` utility call to each rank (vLLM's
``EngineCore.has_work``: its batch queue and DP wave included), and each rank's running and
waiting requests (``EngineDetail.requests``) are its entry's ``requests``, its front end's
counts (``gate_counts``): a value that is not a count (negative, huge, not a number) leaves that
rank's counts unknown, never zero. A plugin too old to answer ``has_work`` (no value and no
failure for it) is unsupported for it (``NOT_PUBLISHED``), never idle.

A target's ranks follow its answers (``follow_ranks``): at most ``MAX_ENGINES`` (an answer naming
more is cut to its first ``MAX_ENGINES`` entries), a rank named again is kept, and a rank missing
from ``RANK_ABSENT_ANSWERS`` answers in a row is dropped (the server scaled down): a hostile or
shrinking server cannot grow the exporter's engines, nor pin the fleet at ``unknown`` with ranks
it no longer has.

Pure functions and values: the client in ``exporter.client.http.client`` does the requests.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from yarl import URL

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.protocol.activity import RequestCounts, read_activity_json
from exporter.protocol.strings import ascii_digits, bound_text, bound_value

PLUGIN_SUFFIX = "/dp"
#: The gate's key of each read method.
GATE_KEYS = {
    "is_sleeping": "sleeping",
    "is_scheduler_paused": "paused",
    "get_weight_version": "weight_version",
    "checkpoint_state": "checkpoint",
    "has_work": "has_work",
}
#: Gate keys an older plugin does not answer: an entry without one (no value, no failure) is
#: unsupported for it (``exporter.fleetstate.invariants.UNSUPPORTED_MARKERS``), not failed.
LATER_KEYS = frozenset({"has_work", "checkpoint"})
NOT_PUBLISHED = "not published by this server (a dp_exporter plugin without it)"
#: Engines one plugin target may report (vLLM's ranks fit in two bytes).
MAX_ENGINES = 1024
#: A rank missing from this many gate answers in a row is dropped; one or two answers without it
#: leave it ``disconnected`` ("not in the server's answer"), as a rank restarting may be.
RANK_ABSENT_ANSWERS = 3
ACTION_HINT = (
    "not sent: admin actions on a plugin-enabled server run on its own POST {url}/admin/<action>"
)


def is_plugin_url(url: str) -> bool:
    return URL(url).path.rstrip("/").endswith(PLUGIN_SUFFIX)


def server_root(url: str) -> str:
    """The vLLM server a plugin target's URL is under (``http://h:8000/dp`` -> ``http://h:8000``),
    where vLLM's own routes (``/fault_tolerance/status``) are."""
    parsed = URL(url)
    path = parsed.path.rstrip("/")
    return str(parsed.with_path(path[: -len(PLUGIN_SUFFIX)] or "/")).rstrip("/")


def engine_label(target: str, rank: str) -> str:
    return f"{target}/{rank}"


@dataclass(frozen=True, slots=True, eq=False)
class GateAnswer:
    """One ``GET <url>/gate`` as the poll's read methods share it: the server's status and
    body, or (``error``) why there is none to read (unreachable, over the read limit, no whole
    answer within two deadlines): every engine of the target is then ``kind`` with that error.
    Compared by identity: one answer moves the target's ranks once (``follow_ranks``)."""

    status: int
    body: bytes
    duration_s: float
    error: str | None = None
    kind: Outcome = Outcome.FAILED

    @classmethod
    def failed(cls, kind: Outcome, error: str, duration_s: float) -> GateAnswer:
        return cls(0, b"", duration_s, error, kind)


def follow_ranks(absent: Mapping[str, int], named: Sequence[str]) -> dict[str, int]:
    """Pure: a target's ranks after one gate answer naming ``named``, each with the number of
    answers in a row that lacked it (``absent``: the same before it). A named rank is kept (0);
    another is dropped at its ``RANK_ABSENT_ANSWERS``-th answer without it, or sooner to keep
    the target within ``MAX_ENGINES`` ranks (the named ones first, then the least missed)."""
    following = dict.fromkeys(named[:MAX_ENGINES], 0)
    older = sorted(absent.items(), key=lambda item: (item[1], int(item[0])))
    for rank, missed in older:
        if len(following) >= MAX_ENGINES:
            break
        if rank not in following and missed + 1 < RANK_ABSENT_ANSWERS:
            following[rank] = missed + 1
    return following


def gate_engines(status: int, body: bytes) -> list[str] | None:
    """The ranks a gate answer names (in rank order), or None when it names none."""
    doc = _doc(status, body)
    if doc is None:
        return None
    ranks = {e["engine"] for e in _entries(doc)}
    return sorted(ranks, key=int) if ranks else None


def gate_counts(status: int, body: bytes) -> dict[str, RequestCounts] | None:
    """Each rank's running and waiting requests from a gate answer (a rank whose ``requests``
    is absent, null or not two counts is left out: unknown); None when it is no gate answer."""
    doc = _doc(status, body)
    if doc is None:
        return None
    return {e["engine"]: e["requests"] for e in _entries(doc) if e["requests"] is not None}


def gate_outcomes(
    target: str,
    ranks: Sequence[str],
    method: str,
    status: int,
    body: bytes,
    duration_s: float,
) -> list[EngineOutcome]:
    """One outcome per rank of ``ranks`` for read method ``method`` from one gate answer."""
    key = GATE_KEYS[method]
    doc = _doc(status, body)
    if doc is None:
        error = _failure_text(status, body)
        kind = Outcome.DISCONNECTED if status == 503 else Outcome.FAILED
        return [EngineOutcome(engine_label(target, r), kind, error=error) for r in ranks]
    by_rank = {e["engine"]: e for e in _entries(doc)}
    outcomes = []
    for rank in ranks:
        label = engine_label(target, rank)
        entry = by_rank.get(rank)
        if entry is None:
            outcomes.append(
                EngineOutcome(label, Outcome.DISCONNECTED, error="not in the server's answer")
            )
            continue
        values = entry["values"]
        if key in values:
            value = bound_value(values[key])
            outcomes.append(EngineOutcome(label, Outcome.OK, value, duration_s=duration_s))
            continue
        outcomes.append(_failed(label, key, entry["failures"], duration_s))
    return outcomes


def _failed(label: str, key: str, failures: list[str], duration_s: float) -> EngineOutcome:
    """The gate's failure text for ``key`` (``"sleeping: timeout"``, ``"paused: unsupported
    by this engine"``, ``"sleeping: failed (why)"``) as an outcome."""
    missing = f"{key}: {NOT_PUBLISHED}" if key in LATER_KEYS else f"{key}: no answer"
    text = next((f for f in failures if f.startswith(f"{key}:")), missing)
    why = text.partition(":")[2].strip()
    if why.startswith("timeout"):
        return EngineOutcome(label, Outcome.TIMEOUT, error=why, duration_s=duration_s)
    if why.startswith("disconnected"):
        return EngineOutcome(label, Outcome.DISCONNECTED, error=why)
    return EngineOutcome(label, Outcome.FAILED, error=why, duration_s=duration_s)


def _doc(status: int, body: bytes) -> dict[str, Any] | None:
    if status not in (200, 412):
        return None
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("engines"), list):
        return None
    return doc


def _entries(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The well-formed per-engine entries (at most ``MAX_ENGINES``): anything else is dropped."""
    entries = []
    for entry in doc["engines"][:MAX_ENGINES]:
        if not isinstance(entry, dict):
            continue
        rank, values, failures = entry.get("engine"), entry.get("values"), entry.get("failures")
        if not (isinstance(rank, str) and ascii_digits(rank) and len(rank) <= 5):
            continue
        if not isinstance(values, dict) or not isinstance(failures, list):
            continue
        unread = entry.get("unread", [])  # a bare gate's reads that did not answer
        said = [*failures, *(unread if isinstance(unread, list) else [])]
        texts = [bound_text(f) for f in said if isinstance(f, str)]
        entries.append(
            {
                "engine": str(int(rank)),
                "values": values,
                "failures": texts,
                "requests": read_activity_json(entry.get("requests")),
            }
        )
    return entries


def _failure_text(status: int, body: bytes) -> str:
    if status == 404:
        return "no dp_exporter plugin on this server (404 on /dp/gate)"
    try:
        doc = json.loads(body)
        error = doc.get("error") if isinstance(doc, dict) else None
    except (ValueError, RecursionError):
        error = None
    detail = f": {bound_text(error)}" if isinstance(error, str) else ""
    return f"HTTP {status} from /dp/gate{detail}"
