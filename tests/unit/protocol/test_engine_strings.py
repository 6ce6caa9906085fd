"""The one rule for strings engines send (``exporter.protocol.strings``), where each mode's
decoder applies it, and the rate-limited inconsistency warning of the poller."""

from __future__ import annotations

import json
import logging

import pytest

from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.client.http.replies import (
    MAX_INCONSISTENT_VALUES,
    interpret,
    parse_inconsistent,
)
from exporter.control.parsing import parse_reset
from exporter.control.poller import Poller
from exporter.control.verdicts import classify
from exporter.metrics.stats import Stats
from exporter.protocol import decode_engine_outputs, encode_utility_reply
from exporter.protocol.strings import (
    CUT_MARKER,
    MAX_ENGINE_STRING,
    MAX_RESULT_NESTING,
    TOO_DEEP,
    bound_bytes,
    bound_text,
    bound_value,
    is_cut,
)

MB = 1_000_000


def fits(text: str) -> bool:
    return len(text.encode()) <= MAX_ENGINE_STRING


@pytest.mark.parametrize(
    "text", ["", "v1", "x" * MAX_ENGINE_STRING, "é" * (MAX_ENGINE_STRING // 2), "日本"]
)
def test_strings_that_fit_are_kept_as_they_are(text: str) -> None:
    assert bound_text(text) == text
    assert not is_cut(text)


@pytest.mark.parametrize(
    "text",
    ["x" * (MAX_ENGINE_STRING + 1), "v" * MB, "é" * 129, "a" + "日" * 300, "🙂" * MB],
)
def test_longer_strings_are_cut_to_the_cap_with_the_marker(text: str) -> None:
    cut = bound_text(text)
    assert fits(cut) and is_cut(cut) and CUT_MARKER in cut
    kept = cut[: cut.index(CUT_MARKER)]
    assert text.startswith(kept) and len(kept) > 0, "the kept part is the string's start"
    assert bound_text(text) == cut, "the same string is always cut the same way"


def test_long_strings_that_differ_after_the_cut_stay_different() -> None:
    """The marker's digest covers the whole string: no false consensus from a cut."""
    a, b = "v" * MB + "a", "v" * MB + "b"
    assert bound_text(a) != bound_text(b)


def test_lone_surrogates_become_replacement_characters() -> None:
    assert bound_text("v\ud800") == "v\ufffd"
    cut = bound_text("\udc80" * MB)
    assert fits(cut) and is_cut(cut)
    cut.encode()  # encodable


def test_bytes_are_cut_by_the_same_rule() -> None:
    assert bound_bytes(b"abc") == b"abc"
    cut = bound_bytes(b"\x00" * MB)
    assert len(cut) <= MAX_ENGINE_STRING and is_cut(cut.decode("utf-8", "replace"))


def test_every_string_of_a_nested_result_is_cut() -> None:
    """A checksum answer with megabyte keys and digests cannot smuggle them anywhere."""
    result = [{"dp0:tp0:" + "k" * MB: "d" * MB, "short": "ok"}, ("x" * MB, 7, 1.5, None, True)]
    bounded = bound_value(result)
    (worker, others) = bounded
    assert all(fits(k) and fits(v) for k, v in worker.items())
    assert worker["short"] == "ok"
    assert len(worker) == 2
    assert isinstance(others, tuple) and fits(others[0]) and others[1:] == (7, 1.5, None, True)
    assert len(json.dumps(bounded)) < 4 * MAX_ENGINE_STRING * 2


def test_results_nested_too_deeply_are_cut() -> None:
    deep: list[object] = ["leaf"]
    for _ in range(MAX_RESULT_NESTING + 5):
        deep = [deep]
    bounded = bound_value(deep)
    for _ in range(MAX_RESULT_NESTING):
        bounded = bounded[0]
    assert bounded == TOO_DEEP


def test_owner_and_relay_replies_are_cut_where_they_are_decoded() -> None:
    failed = decode_engine_outputs(encode_utility_reply(0, 1, failure_message="E" * MB)).utility
    assert failed is not None and failed.failure_message is not None
    assert fits(failed.failure_message) and is_cut(failed.failure_message)
    ok = decode_engine_outputs(encode_utility_reply(0, 2, value=[{"k" * MB: "d"}])).utility
    assert ok is not None
    ((key, digest),) = ok.value[0].items()
    assert fits(key) and is_cut(key) and digest == "d"
    small = decode_engine_outputs(encode_utility_reply(0, 3, value="v1")).utility
    assert small is not None and small.value == "v1"


def test_http_mode_cuts_with_the_same_rule_as_owner_mode() -> None:
    """The same long failure text ends the same in both modes (one rule, one marker)."""
    text = "Call to is_scheduler_paused method failed: " + "E" * MB
    zmq_reply = decode_engine_outputs(encode_utility_reply(0, 1, failure_message=text)).utility
    assert zmq_reply is not None
    body = json.dumps({"error": {"message": text}}).encode()
    http = interpret("0", "is_scheduler_paused", 500, body, 0.01)
    assert http.outcome is Outcome.FAILED
    assert http.error == zmq_reply.failure_message
    version = interpret(
        "0", "get_weight_version", 200, json.dumps({"weight_version": "v" * MB}).encode(), 0.01
    )
    assert version.ok and fits(version.value) and is_cut(version.value)
    assert version.value == bound_text("v" * MB)


def test_values_of_an_inconsistent_http_answer_are_bounded() -> None:
    many = "Engines returned different is_sleeping results: " + repr([True, False] * 2000)
    values = parse_inconsistent(many, "is_sleeping")
    assert values is not None and len(values) == MAX_INCONSISTENT_VALUES + 1
    assert values[-1] == f"…[cut: {4000 - MAX_INCONSISTENT_VALUES} more values]"
    odd = "Engines returned different get_weight_version results: " + repr(
        ["v" * 10_000, {1, 2}, b"raw", None]
    )
    values = parse_inconsistent(odd, "get_weight_version")
    assert values is not None
    long_value, a_set, raw, nothing = values
    assert fits(long_value) and is_cut(long_value)
    assert a_set == "{1, 2}" and raw == "b'raw'" and nothing is None
    json.dumps(values)  # every value can be published


def test_an_unexpected_long_result_is_a_bounded_error() -> None:
    outcome = EngineOutcome("0", Outcome.OK, list(range(100_000)))
    verdict = classify(parse_reset({}, b""), [outcome])
    (failure,) = verdict.failures
    assert failure.error is not None and fits(failure.error) and is_cut(failure.error)


async def test_the_inconsistency_warning_is_logged_once_per_interval_with_a_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    fleet = FakeFleet(
        answers(
            {
                "0": {"is_sleeping": False, "get_weight_version": "v2"},
                "1": {"is_sleeping": False, "get_weight_version": "v1"},
            }
        )
    )
    poller = Poller(
        fleet, Stats(), interval_s=1, call_timeout_s=1, log_interval_s=60, clock=lambda: now[0]
    )
    caplog.set_level(logging.WARNING, logger="exporter.poller")
    for _ in range(20):
        await poller.poll_once()
        now[0] += 1.0
    lines = [r.getMessage() for r in caplog.records if r.name == "exporter.poller"]
    assert len(lines) == 1 and "get_weight_version" in lines[0]
    now[0] += 60
    await poller.poll_once()
    lines = [r.getMessage() for r in caplog.records if r.name == "exporter.poller"]
    assert len(lines) == 2
    assert lines[1].endswith("(19 more inconsistent polls since last report)")
