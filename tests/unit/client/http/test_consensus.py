"""vLLM's consensus error read with bounded work (``exporter.client.http.consensus``, pure):
every form vLLM sends still reads, anything over the bound or of another shape is not one, and
hostile messages of every kind end in a linear pass (a liveness bound, not a timing test)."""

from __future__ import annotations

import ast
import json
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest

from exporter.client.http import consensus
from exporter.client.http.consensus import (
    MAX_CONSENSUS_MESSAGE,
    MAX_INCONSISTENT_VALUES,
    MAX_VALUE_CHARS,
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
        (
            PY.format(m="v") + repr(["a'b\"c", "\x07\t\\", "\u20ac\U0001f600", "\ud800"]),
            "v",
            ("a'b\"c", "\x07\t\\", "\u20ac\U0001f600", "\ufffd"),
        ),
        (
            PY.format(m="v") + r"['\0\101\N{BULLET}\q', 1e+16, -0.0, 7]",
            "v",
            ("\x00A\u2022\\q", 1e16, -0.0, 7),
        ),
        (
            RUST.format(m="v") + r'["\ud83d\ude00\/\b\f\t", -1.5e-3, 0]',
            "v",
            ("\U0001f600/\b\f\t", -0.0015, 0),
        ),
        (RUST.format(m="v") + '[[1, "]"], {"a": [2]}]', "v", ('[1, "]"]', '{"a": [2]}')),
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
        PY.format(m="is_sleeping") + r"['\x4']",  # escapes Python itself refuses
        PY.format(m="is_sleeping") + r"['\N{NO SUCH NAME}']",
        PY.format(m="is_sleeping") + "['a\nb']",  # a newline inside a literal
        RUST.format(m="is_sleeping") + r'["\q"]',
        RUST.format(m="is_sleeping") + r'["\u12"]',
        RUST.format(m="is_sleeping") + '["a\tb"]',  # JSON takes no raw control character
        PY.format(m="is_sleeping") + "[" + "1,]",
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
    long = parse_inconsistent(PY.format(m="v") + repr(["v" * 10_000, "v1"]), "v")
    assert long is not None and is_cut(long[0]) and len(long[0].encode()) <= MAX_ENGINE_STRING
    assert long[1] == "v1"


@pytest.mark.parametrize(
    ("head", "value"),
    [
        (PY, repr("v" * MAX_VALUE_CHARS)),
        (PY, repr("\x01" * MAX_VALUE_CHARS)),
        (RUST, json.dumps("v" * MAX_VALUE_CHARS)),
        (PY, "(" + "1, " * MAX_VALUE_CHARS + ")"),
        (PY, "9" * (MAX_VALUE_CHARS + 1)),
    ],
    ids=["string", "escapes", "json_string", "tuple", "token"],
)
def test_one_value_longer_than_its_cap_is_refused(head: str, value: str) -> None:
    """Within the message's bound, a value whose text is longer than ``MAX_VALUE_CHARS`` is
    refused (no engine's weight version is that long); one just under it is read."""
    message = head.format(m="v") + "[" + value + ", 1]"
    assert len(message) <= MAX_CONSENSUS_MESSAGE
    assert parse_inconsistent(message, "v") is None
    fits = head.format(m="v") + "[" + json.dumps("v" * (MAX_VALUE_CHARS - 2)) + ", 1]"
    assert parse_inconsistent(fits, "v") is not None


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """Count the calls of the consensus module's ``name`` (one list item per call)."""
    calls: list[int] = []
    real: Callable[..., Any] = getattr(consensus, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(consensus, name, counted)
    return calls


@pytest.mark.parametrize(
    "values",
    [["a"] * 20_000, ["a\tb"] * 12_000, [(1,)] * 20_000, [None] * 20_000],
    ids=["strings", "escaped_strings", "tuples", "words"],
)
@pytest.mark.parametrize("form", ["python", "json"])
def test_values_past_the_cap_are_checked_and_counted_never_decoded(
    values: list[Any], form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message of tens of thousands of values within the bound: the first
    ``MAX_INCONSISTENT_VALUES`` are decoded and kept, the rest only checked and counted (each
    kept value cut once: at most ``MAX_INCONSISTENT_VALUES`` cuts, whatever the count)."""
    message = (
        PY.format(m="v") + repr(values)
        if form == "python"
        else RUST.format(m="v") + json.dumps(values)
    )
    assert len(message) <= MAX_CONSENSUS_MESSAGE
    cuts = counting(monkeypatch, "bound_text")
    read = parse_inconsistent(message, "v")
    assert read is not None and len(read) == MAX_INCONSISTENT_VALUES + 1
    assert read[-1] == f"…[cut: {len(values) - MAX_INCONSISTENT_VALUES} more values]"
    assert len(cuts) <= MAX_INCONSISTENT_VALUES


def test_no_python_parser_runs_over_the_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Python literals are read by the scanner itself: ``ast`` (a compiler, megabytes for a
    long literal) never runs."""

    def refuse(*_: Any) -> Any:
        raise AssertionError("ast.literal_eval ran")

    monkeypatch.setattr(ast, "literal_eval", refuse)
    message = PY.format(m="v") + repr(["v1", 'it\'s "v2"\n', None, (1, "x")] * 300)
    read = parse_inconsistent(message, "v")
    assert read is not None and read[:4] == ("v1", 'it\'s "v2"\n', None, "(1, 'x')")


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


MIB = 1024 * 1024
#: Hostile messages of about ``size`` characters, every shape the old parse choked on.
HOSTILE: dict[str, Callable[[int], str]] = {
    "markers": lambda size: (": " + PY.format(m="is_sleeping") + "[") * (size // 50),
    "python_values": lambda size: PY.format(m="is_sleeping") + repr([True, False] * (size // 13)),
    "json_values": lambda size: RUST.format(m="is_sleeping") + json.dumps([True] * (size // 6)),
    "huge_string": lambda size: PY.format(m="is_sleeping") + repr(["x" * size]),
    "deep_nesting": lambda size: PY.format(m="is_sleeping") + "[" * size + "]" * size,
    "unbalanced": lambda size: PY.format(m="is_sleeping") + "[(" * (size // 2) + "]",
}


@pytest.mark.parametrize("size", [MIB, 4 * MIB], ids=["1MiB", "4MiB"])
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_megabyte_message_is_refused_unparsed(
    kind: str, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1 and 4 MiB messages of every hostile shape: refused before the scanner starts (it is
    never called), with no allocation beyond a few KiB (the old parse: seconds of regex, or
    hundreds of MB for ``ast``), well within a liveness bound."""
    message = HOSTILE[kind](size)
    assert len(message) > MAX_CONSENSUS_MESSAGE
    scans = counting(monkeypatch, "read_values")
    tracemalloc.start()
    started = time.process_time()
    try:
        assert parse_inconsistent(message, "is_sleeping") is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - started < 1.0  # liveness, not timing
    assert scans == [] and peak < 64 * 1024, peak


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_the_same_shapes_within_the_bound_cost_bounded_memory(kind: str) -> None:
    """Each shape made to fit the bound: the lists of values read (1,024 kept and the rest
    counted), every other shape refused, in one pass allocating at most a small multiple of
    the message (the values kept are at most 1,024 cut strings)."""
    size = MAX_CONSENSUS_MESSAGE
    message = HOSTILE[kind](size)
    while len(message) > MAX_CONSENSUS_MESSAGE:
        size = size * MAX_CONSENSUS_MESSAGE // len(message) - 64
        message = HOSTILE[kind](size)
    assert len(message) > MAX_CONSENSUS_MESSAGE // 2
    tracemalloc.start()
    started = time.process_time()
    try:
        read = parse_inconsistent(message, "is_sleeping")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.process_time() - started < 1.0  # liveness, not timing
    assert peak < 2 * MIB, peak
    if kind.endswith("_values"):
        assert read is not None and len(read) == MAX_INCONSISTENT_VALUES + 1
    else:
        assert read is None
