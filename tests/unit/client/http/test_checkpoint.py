"""vLLM 0.34's checkpoint routes read by HTTP mode (pure): every status carries the state."""

from __future__ import annotations

import json

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.replies import interpret
from exporter.client.http.routes import route


def body(state: str, error: str | None = None) -> bytes:
    doc = {"state": state} if error is None else {"state": state, "error": error}
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("status", "state", "error"),
    [
        (200, "prepared", None),
        (503, "running", None),
        (503, "preparing", None),
        (503, "restoring", None),
        (500, "failed", "CUDA error: device lost"),
    ],
)
def test_the_status_route_answers_a_state_with_every_status(
    status: int, state: str, error: str | None
) -> None:
    o = interpret("a", "checkpoint_state", status, body(state, error), 0.01)
    assert (o.outcome, o.value) == (Outcome.OK, [state, error])


@pytest.mark.parametrize(
    ("status", "raw"),
    [
        (503, b"Service Unavailable"),  # a proxy's 503, not vLLM's answer
        (200, b'{"state": "snapshotting"}'),  # a state 0.34 does not name
        (200, b'{"state": "running", "error": 7}'),
        (500, b'{"error": {"message": "boom"}}'),
        (200, b"[" * 100_000),
    ],
)
def test_an_answer_without_a_known_state_is_a_failure(status: int, raw: bytes) -> None:
    o = interpret("a", "checkpoint_state", status, raw, 0.01)
    assert o.outcome is Outcome.FAILED


def test_a_404_is_unsupported_before_0_34_or_without_sleep_mode() -> None:
    o = interpret("a", "checkpoint_state", 404, b'{"detail": "Not Found"}', 0.01)
    assert o.outcome is Outcome.FAILED and o.error is not None
    assert "route not found" in o.error


def test_prepare_answers_none_once_started_and_its_refusal_as_text() -> None:
    started = interpret("a", "checkpoint_prepare", 200, body("preparing"), 0.01)
    assert (started.outcome, started.value) == (Outcome.OK, None)
    refusal = body("running", "Preparing for a checkpoint requires an awake engine")
    refused = interpret("a", "checkpoint_prepare", 400, refusal, 0.01)
    assert refused.outcome is Outcome.OK and "awake engine" in str(refused.value)
    busy = interpret("a", "checkpoint_prepare", 400, body("restoring"), 0.01)
    assert busy.value == "the checkpoint state is restoring"


def test_restore_answers_none_or_fails_naming_the_state() -> None:
    assert interpret("a", "checkpoint_restore", 200, body("running"), 0.01).value is None
    failed = interpret("a", "checkpoint_restore", 400, body("failed", "boom"), 0.01)
    assert failed.outcome is Outcome.FAILED
    assert failed.error == "cannot restore while the checkpoint state is failed (boom)"


def test_the_routes() -> None:
    assert route("checkpoint_state").path == "/checkpoint/status"
    prepare = route("checkpoint_prepare", ("abort",))
    assert (prepare.verb, prepare.path, prepare.query) == (
        "POST",
        "/checkpoint/prepare",
        [("mode", "abort")],
    )
    assert route("checkpoint_restore").verb == "POST"


@pytest.mark.parametrize("method", ["is_sleeping", "get_weight_version", "checkpoint_state"])
def test_a_200_nested_past_the_json_decoder_is_a_failure_not_an_exception(method: str) -> None:
    o = interpret("a", method, 200, b"[" * 100_000, 0.01)
    assert o.outcome is Outcome.FAILED
    assert o.error == "response is nested too deeply to be an answer"
