"""HTTP mode against vLLM's Rust front end (``VLLM_USE_RUST_FRONTEND=1``): its consensus error,
as measured on vLLM 0.32 and 0.33, is an inconsistency with every engine's value,
never a failed call; anything that only looks like one stays a failed call."""

from __future__ import annotations

import json

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.replies import interpret, parse_inconsistent


def envelope(message: str, kind: str = "server_error") -> bytes:
    """The Rust front end's 500 body (0.32: ``server_error``; 0.33: ``InternalServerError``)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": 500}}
    return json.dumps(body).encode()


def rust(method: str, values: str) -> str:
    return (
        (
            f"failed to call {method}: utility call `{method}` returned inconsistent results "
            f"across engines: {values}"
        )
        .encode()
        .decode()
    )


@pytest.mark.parametrize("kind", ["server_error", "InternalServerError"])
@pytest.mark.parametrize(
    ("method", "values", "expected"),
    [
        ("is_sleeping", "[false, true]", (False, True)),
        ("is_scheduler_paused", "[true, false, true]", (True, False, True)),
        ("get_weight_version", '["rl-7", "rl-8", null]', ("rl-7", "rl-8", None)),
    ],
)
def test_the_consensus_error_is_inconsistent_with_each_engines_value(
    kind: str, method: str, values: str, expected: tuple[object, ...]
) -> None:
    message = rust(method, values)
    outcome = interpret("rs", method, 500, envelope(message, kind), 0.01)
    assert outcome.outcome is Outcome.INCONSISTENT
    assert outcome.values == expected
    assert outcome.error == message


@pytest.mark.parametrize(
    ("method", "message"),
    [
        # another method's disagreement is not this call's answer
        ("is_sleeping", rust("is_scheduler_paused", "[false, true]")),
        # values that are not JSON (the Python server's repr is another message)
        ("is_sleeping", rust("is_sleeping", "[False, True]")),
        ("is_sleeping", rust("is_sleeping", "[false, tr")),
        ("is_sleeping", rust("is_sleeping", '{"a": 1}')),
        # the words without the method in backquotes
        (
            "is_sleeping",
            "utility call is_sleeping returned inconsistent results across engines: []",
        ),
    ],
)
def test_what_only_looks_like_it_is_a_failed_call(method: str, message: str) -> None:
    assert parse_inconsistent(message, method) is None
    outcome = interpret("rs", method, 500, envelope(message), 0.01)
    assert outcome.outcome is Outcome.FAILED
    assert outcome.error == message


def test_a_deeply_nested_value_list_is_refused_not_a_crash() -> None:
    message = rust("get_weight_version", "[" * 100_000 + "]" * 100_000)
    assert parse_inconsistent(message, "get_weight_version") is None


def test_the_python_servers_message_still_reads_as_before() -> None:
    message = "Engines returned different is_sleeping results: [False, True]"
    assert parse_inconsistent(message, "is_sleeping") == (False, True)
