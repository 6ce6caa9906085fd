"""``exporter/protocol/elastic_ep.py``: vLLM's ``POST /is_scaling_elastic_ep`` answers (0.33,
0.32) and ``get_external_elastic_ep_status()`` maps read by one rule; hostile answers are a
clear ``UnreadableAnswer``, never a crash."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exporter.protocol.elastic_ep import (
    ELASTIC_EP_PHASES,
    KNOWN_PHASES,
    MAX_DATA_PARALLEL_SIZE,
    MAX_ELASTIC_EP_ANSWER,
    ElasticEpOperation,
    UnreadableAnswer,
    error_detail,
    read_answer,
    read_status,
)
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING


def answer(**fields: Any) -> bytes:
    """vLLM 0.33's answer, ``fields`` changed."""
    doc = {
        "is_scaling_elastic_ep": False,
        "phase": "idle",
        "epoch": None,
        "error": None,
        "requested_data_parallel_size": None,
    }
    doc.update(fields)
    return json.dumps(doc).encode()


@pytest.mark.parametrize("phase", KNOWN_PHASES)
def test_every_phase_of_vllm_033_is_read_as_itself(phase: str) -> None:
    scaling = phase in ("preparing", "committing")
    op = read_answer(
        answer(
            is_scaling_elastic_ep=scaling,
            phase=phase,
            epoch="3f2a",
            error="boom" if phase == "failed" else None,
            requested_data_parallel_size=4,
        )
    )
    assert op == ElasticEpOperation(
        phase, "3f2a", "boom" if phase == "failed" else None, 4, scaling, None
    )


def test_vllm_032_answers_only_the_flag() -> None:
    assert read_answer(b'{"is_scaling_elastic_ep": true}') == ElasticEpOperation(
        "committing", scaling=True
    )
    assert read_answer(b'{"is_scaling_elastic_ep": false}') == ElasticEpOperation(
        "idle", scaling=False
    )


def test_the_in_process_status_map_takes_scaling_from_the_phase() -> None:
    """``get_external_elastic_ep_status()`` has no ``is_scaling_elastic_ep``: vLLM's route
    computes it from the phase, so does the reader."""
    status = {"phase": "preparing", "epoch": "e1", "error": None, "requested_data_parallel_size": 8}
    assert read_status(status) == ElasticEpOperation("preparing", "e1", None, 8, scaling=True)
    assert read_status({**status, "phase": "completed"}).scaling is False


def test_an_unknown_phase_is_other_and_kept_cut() -> None:
    op = read_answer(answer(phase="rebalancing"))
    assert (op.phase, op.reported_phase) == ("other", "rebalancing")
    huge = read_answer(answer(phase="p" * 60_000))
    assert huge.phase == "other" and huge.reported_phase is not None
    assert CUT_MARKER in huge.reported_phase
    assert len(huge.reported_phase.encode()) <= MAX_ENGINE_STRING
    assert set(ELASTIC_EP_PHASES) == {*KNOWN_PHASES, "other"}


def test_strings_are_cut_by_the_one_rule() -> None:
    op = read_answer(answer(phase="failed", error="E" * 30_000, epoch="\u00e9" * 3_000))
    huge = read_status({"phase": "failed", "error": "E" * 10**6}).error  # in-process: no limit
    assert huge is not None and len(huge.encode()) <= MAX_ENGINE_STRING
    assert op.error is not None and op.epoch is not None
    for text in (op.error, op.epoch):
        assert CUT_MARKER in text and len(text.encode()) <= MAX_ENGINE_STRING


@pytest.mark.parametrize(
    ("epoch", "number"),
    [
        *[("42", 42), ("0", 0), ("007", 7), ("9" * 15, int("9" * 15)), ("9" * 16, None)],
        *[("3f2a", None), ("-1", None), ("1.5", None), ("", None), (None, None), (" 4", None)],
    ],
)
def test_only_a_whole_number_epoch_has_a_number(epoch: str | None, number: int | None) -> None:
    assert ElasticEpOperation("committing", epoch=epoch).epoch_number == number


HOSTILE: dict[str, tuple[bytes, str]] = {
    "not_json": (b"<html>502 Bad Gateway</html>", "not JSON"),
    "not_utf8": (b"\xff\xfe{", "not JSON"),
    "empty": (b"", "not JSON"),
    "deep_nesting": (b"[" * 30_000 + b"]" * 30_000, "not JSON"),
    "a_list": (b'[{"phase": "failed"}]', "list, not a JSON object"),
    "a_number": (b"3", "int, not a JSON object"),
    "nothing_said": (b"{}", "neither phase nor is_scaling_elastic_ep"),
    "flag_a_string": (b'{"is_scaling_elastic_ep": "true"}', "is_scaling_elastic_ep is str"),
    "flag_a_number": (b'{"is_scaling_elastic_ep": 1}', "is_scaling_elastic_ep is int"),
    "phase_a_number": (answer(phase=3), "phase is int"),
    "phase_nested": (answer(phase={"a": [["b"]]}), "phase is dict"),
    "phase_null_flag_null": (b'{"phase": null}', "neither"),
    "epoch_a_number": (answer(epoch=7), "epoch is int"),
    "error_a_list": (answer(error=["x"]), "error is list"),
    "size_a_string": (answer(requested_data_parallel_size="4"), "requested_data_parallel_size"),
    "size_a_bool": (answer(requested_data_parallel_size=True), "requested_data_parallel_size"),
    "size_zero": (answer(requested_data_parallel_size=0), "requested_data_parallel_size is 0"),
    "size_huge": (answer(requested_data_parallel_size=10**400), "requested_data_parallel_size"),
    "size_a_float": (answer(requested_data_parallel_size=4.0), "requested_data_parallel_size"),
    "too_long": (answer(error="x" * MAX_ELASTIC_EP_ANSWER), "longer than"),
}


@pytest.mark.parametrize(("body", "why"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_answers_are_unreadable_with_a_short_reason(body: bytes, why: str) -> None:
    with pytest.raises(UnreadableAnswer) as caught:
        read_answer(body)
    message = str(caught.value)
    assert why in message
    assert len(message) < 200  # never echoes the value


def test_the_largest_size_is_read_and_unknown_keys_are_ignored() -> None:
    body = answer(requested_data_parallel_size=MAX_DATA_PARALLEL_SIZE, extra={"a": [1] * 100})
    assert read_answer(body).requested_data_parallel_size == MAX_DATA_PARALLEL_SIZE


UNAVAILABLE = "External Elastic EP status is temporarily unavailable"


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (
            json.dumps(
                {"error": {"message": UNAVAILABLE, "type": "Service Unavailable", "code": 503}}
            ).encode(),
            UNAVAILABLE,
        ),
        (json.dumps({"detail": UNAVAILABLE}).encode(), UNAVAILABLE),
        (b'{"error": "The model is currently scaling."}', "The model is currently scaling."),
        (b"not json", None),
        (b'{"error": {"message": 3}}', None),
        (b"[]", None),
    ],
)
def test_error_details(body: bytes, detail: str | None) -> None:
    assert error_detail(body) == detail


def test_a_long_error_detail_is_cut() -> None:
    cut = error_detail(json.dumps({"detail": "d" * 10_000}).encode())
    assert cut is not None and CUT_MARKER in cut and len(cut.encode()) <= MAX_ENGINE_STRING
