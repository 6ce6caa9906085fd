"""vLLM's consensus error read with bounded work (``exporter.client.http.consensus``, pure):
every form vLLM sends still reads, anything over the bound or of another shape is not one, and
hostile messages of every kind end in a linear pass (a liveness bound, not a timing test)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from exporter.client.http.consensus import (
    MAX_CONSENSUS_MESSAGE,
    MAX_INCONSISTENT_VALUES,
    MAX_VALUE_DEPTH,
    parse_inconsistent,
)
from exporter.protocol.strings import MAX_ENGINE_STRING, is_cut

PY = "Engines returned different {m} results: "
RUST = "failed to call {m}: utility call `{m}` returned inconsistent results across engines: "


@pytest.mark.parametrize(
    ("message", "method", "expected"),
    [
        (PY.format(m="is_sleeping") + "[False, True]", "is_sleeping", (False, True)),
        (
            "Failed to fetch pause status: " + PY.format(m="is_scheduler_paused") + "[True, False]",
            "is_scheduler_paused",
            (True, False),
        ),
        (
            PY.format(m="get_weight_version") + "['v1', None, \"v'2\"]",
            "get_weight_version",
            ("v1", None, "v'2"),
        ),
        (
            PY.format(m="get_weight_version") + r"['a\nb', 'é\x00']",
            "get_weight_version",
            ("a\nb", "é\x00"),
        ),
        (
            PY.format(m="x") + "[1, -2, 3.5, nan, -inf, 1e3]",
            "x",
            (1, -2, 3.5, pytest.approx(float("nan"), nan_ok=True), float("-inf"), 1000.0),
        ),
        (
            PY.format(m="x") + "[(1, 2), {'a': [1]}, b'raw', {1, 2}]",
            "x",
            ("(1, 2)", "{'a': [1]}", "b'raw'", "{1, 2}"),
        ),
        (RUST.format(m="is_sleeping") + "[false, true]", "is_sleeping", (False, True)),
        (
            RUST.format(m="get_weight_version") + '["v1", null, "a\\"b\\u00e9"]',
            "get_weight_version",
            ("v1", None, 'a"bé'),
        ),
        ("  " + PY.format(m="is_sleeping") + "[ False ,True ]  \n", "is_sleeping", (False, True)),
        (PY.format(m="is_sleeping") + "[]", "is_sleeping", ()),
    ],
)
def test_every_form_vllm_sends_reads(message: str, method: str, expected: tuple[Any, ...]) -> None:
    assert parse_inconsistent(message, method) == expected


@pytest.mark.parametrize(
    "message",
    [
        PY.format(m="is_scheduler_paused") + "[False, True]",  # another method's disagreement
        "X" + PY.format(m="is_sleeping") + "[False, True]",  # the marker inside a word
        PY.format(m="is_sleeping") + "[False, True] and more",  # text after the list
        PY.format(m="is_sleeping") + "[False, True",  # never closed
        PY.format(m="is_sleeping") + "[False,, True]",
        PY.format(m="is_sleeping") + "[False True]",
        PY.format(m="is_sleeping") + "['open]",
        PY.format(m="is_sleeping") + "[maybe]",
        PY.format(m="is_sleeping") + "[" + "1" * 100 + "]",  # a number no engine sends
        RUST.format(m="is_sleeping") + "[False, True]",  # Python words in the JSON form
        RUST.format(m="is_sleeping") + "['single']",
        "utility call is_sleeping returned inconsistent results across engines: []",
        PY.format(m="is_sleeping") + "[" * (MAX_VALUE_DEPTH + 2) + "]" * (MAX_VALUE_DEPTH + 2),
        PY.format(m="is_sleeping") + "[(1, 2]]",  # brackets that do not match
    ],
)
def test_anything_else_is_not_a_consensus_error(message: str) -> None:
    assert parse_inconsistent(message, "is_sleeping") is None


def test_the_bound_is_checked_before_any_work() -> None:
    head = PY.format(m="is_sleeping") + "["
    fits = head + "False, " * ((MAX_CONSENSUS_MESSAGE - len(head) - 6) // 7) + "True]"
    assert len(fits) <= MAX_CONSENSUS_MESSAGE
    assert parse_inconsistent(fits, "is_sleeping") is not None
    over = fits[:-1] + " " * (MAX_CONSENSUS_MESSAGE - len(fits) + 1) + "]"
    assert len(over) > MAX_CONSENSUS_MESSAGE
    assert parse_inconsistent(over, "is_sleeping") is None


def test_values_beyond_the_cap_are_counted_and_strings_cut() -> None:
    many = RUST.format(m="is_sleeping") + json.dumps([True, False] * 2000)
    values = parse_inconsistent(many, "is_sleeping")
    assert values is not None and len(values) == MAX_INCONSISTENT_VALUES + 1
    assert values[-1] == f"…[cut: {4000 - MAX_INCONSISTENT_VALUES} more values]"
    long = parse_inconsistent(PY.format(m="v") + repr(["v" * 50_000, "v1"]), "v")
    assert long is not None and is_cut(long[0]) and len(long[0].encode()) <= MAX_ENGINE_STRING
    assert long[1] == "v1"


@pytest.mark.parametrize(
    "message",
    [
        (": " + PY.format(m="is_sleeping") + "[") * (4 * 1024 * 1024 // 50),
        PY.format(m="is_sleeping") + "[" * (4 * 1024 * 1024),
        PY.format(m="is_sleeping") + "[" + "'" + "x" * (MAX_CONSENSUS_MESSAGE - 60),
        (": " + PY.format(m="is_sleeping") + "[") * (MAX_CONSENSUS_MESSAGE // 52),
        PY.format(m="is_sleeping") + "[" + "(" * 31 + "'\\'" * 30_000,
    ],
    ids=["4MiB_markers", "4MiB_nesting", "open_string", "markers_within_the_bound", "escapes"],
)
def test_hostile_messages_end_in_one_linear_pass(message: str) -> None:
    started = time.process_time()
    assert parse_inconsistent(message, "is_sleeping") is None
    assert time.process_time() - started < 1.0  # liveness: a backtracking parse took seconds
