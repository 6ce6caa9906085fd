"""Weight checksums compared across DP ranks (pure).

``compute_weight_checksums`` answers, per engine, a list of ``{key: digest}`` maps (one per
worker); a key starts with the worker's position (``dp``/``pp``/``pcp``/``tp``) and ends with
the parameter name. The same pipeline/context/tensor position and parameter must have the same
digest on every DP rank. Keys are compared per engine with the ``dp`` component removed (dense
DP ranks all call themselves ``dp0``, which is why flattening every engine's maps into one
dictionary, as a per-front-end checker does, loses ranks).

A digest of empty input cannot tell two weights apart: vLLM hashes each parameter's bytes
(``hashlib.sha256`` over the tensor viewed as bytes, ``vllm/model_executor/model_loader/
weight_checksum.py``), and a tensor with no bytes (the CPU build's packed linear layers keep
their weights elsewhere) hashes to ``e3b0c442...b855`` on every rank whatever it holds. A
parameter whose digest is an empty-input digest on every engine that has it is *unverifiable*:
not compared, listed apart; on some engines only, it is compared as usual (a mismatch).
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: Mismatching parameters listed per engine in an answer (the count is always complete).
MAX_LISTED = 20
_DP = re.compile(r"(^|[/_.:-])dp\d+(?=[/_.:-]|$)")
#: vLLM's algorithm (``compute_tensor_digests``, vLLM 0.32): SHA-256 of the bytes.
VLLM_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()  # e3b0c442...52b855


def _empty_digests() -> frozenset[str]:
    """vLLM's empty digest and every fixed-length ``hashlib`` algorithm's (a later vLLM may
    change its algorithm; no digest of non-empty input is one of these)."""
    found = {VLLM_EMPTY_DIGEST}
    for name in hashlib.algorithms_guaranteed:
        if name.startswith("shake_"):  # variable length: no one empty digest
            continue
        try:
            found.add(hashlib.new(name, b"", usedforsecurity=False).hexdigest())
        except ValueError:  # refused by this build (FIPS)
            continue
    return frozenset(found)


#: Hex digests of empty input.
EMPTY_DIGESTS = _empty_digests()


def is_empty_digest(digest: str) -> bool:
    """Whether ``digest`` is the hash of zero bytes (compared as lower-case hex)."""
    return digest.strip().lower() in EMPTY_DIGESTS


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
    #: Parameters actually compared: ``parameters`` less the unverifiable ones.
    compared: int = 0
    #: Parameters whose digest is an empty-input digest on every engine that has them.
    unverifiable: int = 0
    unverifiable_listed: tuple[str, ...] = ()  # at most MAX_LISTED of them


def compare(per_engine: Mapping[str, Mapping[str, str]]) -> list[EngineComparison]:
    """Each engine against the majority digest of every key over all engines given.

    A key missing on an engine counts as a mismatch for it; a key whose digests are split
    without a strict majority counts as a mismatch for every engine holding it. A key whose
    digest is an empty-input digest on every engine holding it is unverifiable, not compared
    (still a mismatch for an engine that lacks it).
    """
    keys: set[str] = set()
    for flat in per_engine.values():
        keys.update(flat)
    majority: dict[str, str | None] = {}
    unverifiable: set[str] = set()
    for key in keys:
        held = [flat[key] for flat in per_engine.values() if key in flat]
        if all(is_empty_digest(digest) for digest in held):
            unverifiable.add(key)
        (digest, n), *rest = Counter(held).most_common(2) or [("", 0)]
        tie = bool(rest) and rest[0][1] == n
        majority[key] = None if tie or n * 2 <= len(per_engine) else digest
    out = []
    for engine, flat in per_engine.items():
        bad = sorted(
            key
            for key in keys
            if key not in flat or (key not in unverifiable and flat[key] != majority[key])
        )
        blind = sorted(unverifiable.intersection(flat))
        out.append(
            EngineComparison(
                engine,
                len(flat),
                len(bad),
                tuple(bad[:MAX_LISTED]),
                not bad,
                compared=len(flat) - len(blind),
                unverifiable=len(blind),
                unverifiable_listed=tuple(blind[:MAX_LISTED]),
            )
        )
    return out


def comparison_json(results: Iterable[EngineComparison]) -> list[dict[str, Any]]:
    return [
        {
            "engine": r.engine,
            "parameters": r.parameters,
            "mismatches": r.mismatches,
            "mismatching_parameters": list(r.listed),
            "agrees_with_majority": r.agrees_with_majority,
            "compared": r.compared,
            "unverifiable": r.unverifiable,
            "unverifiable_parameters": list(r.unverifiable_listed),
        }
        for r in results
    ]
