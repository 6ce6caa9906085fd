"""Weight checksums compared across DP ranks (pure).

``compute_weight_checksums`` answers, per engine, a list of ``{key: digest}`` maps (one per
worker); a key starts with the worker's position (``dp``/``pp``/``pcp``/``tp``) and ends with
the parameter name. The same pipeline/context/tensor position and parameter must have the same
digest on every DP rank. Keys are compared per engine with the ``dp`` component removed (dense
DP ranks all call themselves ``dp0``, which is why flattening every engine's maps into one
dictionary, as a per-front-end checker does, loses ranks).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Mismatching parameters listed per engine in an answer (the count is always complete).
MAX_LISTED = 20
_DP = re.compile(r"(^|[/_.:-])dp\d+(?=[/_.:-]|$)")


def comparison_key(key: str) -> str:
    """``key`` without its data-parallel component: what must agree across DP ranks."""
    stripped = _DP.sub(r"\1", key, count=1)
    return stripped.lstrip("/_.:-") or key


class ChecksumShapeError(ValueError):
    """An engine's answer is not a list of {key: digest} maps."""


def flatten(result: Any) -> dict[str, str]:
    """One engine's answer as ``{comparison key: digest}``."""
    maps = result if isinstance(result, list) else [result]
    flat: dict[str, str] = {}
    for worker in maps:
        if not isinstance(worker, Mapping):
            raise ChecksumShapeError("expected a list of {parameter: checksum} maps")
        for key, digest in worker.items():
            if not isinstance(key, str):
                raise ChecksumShapeError("parameter names must be strings")
            flat[comparison_key(key)] = str(digest)
    return flat


@dataclass(frozen=True, slots=True)
class EngineComparison:
    engine: str
    parameters: int
    mismatches: int
    listed: tuple[str, ...]  # at most MAX_LISTED of the mismatching keys
    agrees_with_majority: bool


def compare(per_engine: Mapping[str, Mapping[str, str]]) -> list[EngineComparison]:
    """Each engine against the majority digest of every key over all engines given.

    A key missing on an engine counts as a mismatch for it; a key whose digests are split
    without a strict majority counts as a mismatch for every engine holding it.
    """
    keys: set[str] = set()
    for flat in per_engine.values():
        keys.update(flat)
    majority: dict[str, str | None] = {}
    for key in keys:
        counts = Counter(flat[key] for flat in per_engine.values() if key in flat)
        (digest, n), *rest = counts.most_common(2) or [("", 0)]
        tie = bool(rest) and rest[0][1] == n
        majority[key] = None if tie or n * 2 <= len(per_engine) else digest
    out = []
    for engine, flat in per_engine.items():
        bad = sorted(
            key
            for key in keys
            if key not in flat or majority[key] is None or flat[key] != majority[key]
        )
        out.append(EngineComparison(engine, len(flat), len(bad), tuple(bad[:MAX_LISTED]), not bad))
    return out


def comparison_json(results: Iterable[EngineComparison]) -> list[dict[str, Any]]:
    return [
        {
            "engine": r.engine,
            "parameters": r.parameters,
            "mismatches": r.mismatches,
            "mismatching_parameters": list(r.listed),
            "agrees_with_majority": r.agrees_with_majority,
        }
        for r in results
    ]
