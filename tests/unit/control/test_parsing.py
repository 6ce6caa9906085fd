"""``exporter/control/parsing.py``: what each admin action's query and body may say, and the
call, canonical parameters and read-back they become (pure). The arguments of each action and
its plainly bad values are in tests/unit/control/test_rl_semantics.py."""

from __future__ import annotations

import pytest

from exporter.control.parsing import (
    MAX_WEIGHT_VERSION,
    BadActionRequest,
    Check,
    Parser,
    parse_pause,
    parse_reset,
    parse_reset_flags,
    parse_resume,
    parse_sleep,
    parse_wake_up,
    parse_weight_version,
    plain,
    reset_request,
)
from exporter.fleetstate.invariants import PAUSED, SLEEPING


def test_sleep_sends_the_mode_only_when_asked_and_names_its_default() -> None:
    request = parse_sleep({"level": ["2"]}, b"")
    assert request.args == (2,) and request.params == {"level": 2, "mode": "abort"}
    assert request.check == Check(SLEEPING, True)
    request = parse_sleep({"mode": ["keep"]}, b"")
    assert request.args == (1, "keep") and request.params == {"level": 1, "mode": "keep"}


def test_wake_up_reads_back_only_when_it_wakes_everything() -> None:
    assert parse_wake_up({}, b"").check == Check(SLEEPING, False)
    both = parse_wake_up({"tags": ["kv_cache", " weights "]}, b"")
    assert both.args == (["kv_cache", "weights"],) and both.check == Check(SLEEPING, False)
    one = parse_wake_up({"tags": ["weights,weights"]}, b"")
    assert one.args == (["weights"],) and one.params == {"tags": ["weights"]}
    assert one.check is None  # the KV cache may still sleep: nothing to read back


def test_pause_and_resume_read_the_scheduler_back() -> None:
    assert parse_pause({}, b"").args == ("abort",)
    assert parse_pause({}, b"").check == Check(PAUSED, True)
    assert parse_resume({}, b"").check == Check(PAUSED, False)


def test_a_pause_sends_clear_cache_only_when_asked() -> None:
    kept = parse_pause({"mode": ["keep"], "clear_cache": ["false"]}, b"")
    assert (kept.args, kept.params) == (("keep", False), {"mode": "keep", "clear_cache": False})
    assert kept.check == Check(PAUSED, True) and not kept.check_drained
    cleared = parse_pause({"mode": ["wait"], "clear_cache": ["1"]}, b"")
    assert (cleared.args, cleared.check_drained) == (("wait", True), True)
    assert parse_pause({"mode": ["keep"]}, b"").params == {"mode": "keep"}  # as before
    with pytest.raises(BadActionRequest, match="clear_cache"):
        parse_pause({"clear_cache": ["no"]}, b"")


@pytest.mark.parametrize(
    ("parser", "query"),
    [
        (parse_sleep, {"level": ["1", "2"]}),
        (parse_pause, {"mode": ["wait", "wait"]}),
        (parse_wake_up, {"level": ["1"]}),
        (parse_reset, {"reset_connector": ["true", "true"]}),
        (parse_reset, {"reset": ["true"]}),
    ],
)
def test_an_unknown_or_repeated_query_parameter_is_refused(
    parser: Parser, query: dict[str, list[str]]
) -> None:
    with pytest.raises(BadActionRequest, match=r"unknown query parameter|given more than once"):
        parser(query, b"")


@pytest.mark.parametrize("parser", [parse_sleep, parse_wake_up, parse_pause, parse_resume])
def test_actions_without_a_body_refuse_one_but_not_whitespace(parser: Parser) -> None:
    with pytest.raises(BadActionRequest, match="takes no request body"):
        parser({}, b'{"level": 2}')
    parser({}, b" \r\n")


def test_an_action_without_parameters_takes_no_query_and_no_body() -> None:
    parse = plain("reset_encoder_cache", "reset_encoder_cache")
    request = parse({}, b"")
    assert (request.method, request.args, request.params, request.check) == (
        "reset_encoder_cache",
        (),
        {},
        None,
    )
    with pytest.raises(BadActionRequest):
        parse({"now": ["1"]}, b"")
    with pytest.raises(BadActionRequest, match="reset_encoder_cache takes no request body"):
        parse({}, b"x")


def test_a_weight_version_is_one_to_256_characters_of_unicode_text() -> None:
    longest = "v" * MAX_WEIGHT_VERSION
    assert parse_weight_version({}, f'{{"weight_version": "{longest}"}}'.encode()).args == (
        longest,
    )
    assert parse_weight_version({}, '{"weight_version": "ü✓"}'.encode()).args == ("ü✓",)
    for body in (
        f'{{"weight_version": "{longest}v"}}'.encode(),
        b'{"weight_version": "v\\ud800"}',  # a lone surrogate: no engine can be sent it
        b"[" * 100_000,  # deeper than the decoder goes
        b'{"weight_version": null}',
    ):
        with pytest.raises(BadActionRequest):
            parse_weight_version({}, body)
    with pytest.raises(BadActionRequest):
        parse_weight_version({"x": ["1"]}, b'{"weight_version": "v"}')


@pytest.mark.parametrize(
    ("query", "flags"),
    [
        ({}, (False, False)),
        ({"reset_running_requests": ["TRUE"]}, (True, False)),
        ({"reset_connector": ["1"]}, (False, True)),
        ({"reset_external": ["true"]}, (False, True)),
        ({"reset_connector": ["0"], "reset_external": ["false"]}, (False, False)),
    ],
)
def test_the_reset_flags_and_the_connector_alias(
    query: dict[str, list[str]], flags: tuple[bool, bool]
) -> None:
    parsed = parse_reset_flags(query)
    assert (parsed["reset_running_requests"], parsed["reset_connector"]) == flags


@pytest.mark.parametrize(
    "query",
    [
        {"reset_connector": ["true"], "reset_external": ["false"]},
        {"reset_running_requests": ["yes"]},
        {"reset_connector": [""]},
    ],
)
def test_reset_flags_that_disagree_or_are_not_booleans_are_refused(
    query: dict[str, list[str]],
) -> None:
    with pytest.raises(BadActionRequest):
        parse_reset_flags(query)


def test_the_reset_sends_the_fewest_arguments_and_wants_the_engines_true() -> None:
    assert reset_request(False, False).args == ()
    assert reset_request(True, False).args == (True,)
    assert reset_request(False, True).args == (False, True)
    request = parse_reset({"reset_external": ["1"]}, b"any body is ignored")
    assert request.params == {"reset_running_requests": False, "reset_connector": True}
    assert request.expect_true and request.check is None


def test_the_fingerprint_is_the_action_and_its_canonical_parameters() -> None:
    same = parse_sleep({"level": ["1"]}, b"").fingerprint
    assert parse_sleep({}, b"").fingerprint == same  # level 1 is the default
    assert parse_sleep({"level": ["2"]}, b"").fingerprint != same
    assert parse_pause({}, b"").fingerprint != parse_sleep({"mode": ["abort"]}, b"").fingerprint


@pytest.mark.parametrize(
    ("parser", "query", "drained"),
    [
        (parse_pause, {"mode": ["wait"]}, True),
        (parse_pause, {"mode": ["keep"]}, False),
        (parse_pause, {"mode": ["abort"]}, False),
        (parse_pause, {}, False),  # abort: the work is dropped, nothing to wait for
        (parse_sleep, {"mode": ["wait"]}, True),
        (parse_sleep, {"mode": ["wait"], "level": ["0"]}, True),
        (parse_sleep, {"mode": ["keep"]}, False),
        (parse_sleep, {}, False),
        (parse_resume, {}, False),
        (parse_wake_up, {}, False),
    ],
)
def test_only_a_mode_that_waits_for_the_work_reads_has_work_back(
    parser: Parser, query: dict[str, list[str]], drained: bool
) -> None:
    request = parser(query, b"")
    assert request.check_drained is drained
    assert request.check is not None  # the state read back whatever the mode
    assert parse_pause({"mode": ["wait"]}, b"").params == {"mode": "wait"}


@pytest.mark.parametrize("mode", ["WAIT", "drain", "", "wait "])
def test_a_pause_mode_is_one_of_vllms_exactly(mode: str) -> None:
    with pytest.raises(BadActionRequest, match="mode"):
        parse_pause({"mode": [mode]}, b"")


def test_checkpoint_prepare_takes_vllms_modes_and_reads_back_preparing_or_prepared() -> None:
    from exporter.control.parsing import parse_checkpoint_prepare, parse_checkpoint_restore

    request = parse_checkpoint_prepare({}, b"")
    assert (request.method, request.args, request.params) == (
        "checkpoint_prepare",
        ("wait",),
        {"mode": "wait"},
    )
    assert request.expect_none and request.check is not None
    assert request.check.holds(["preparing", None]) and request.check.holds(["prepared", None])
    assert not request.check.holds(["failed", "boom"]) and not request.check.holds("prepared")
    assert parse_checkpoint_prepare({"mode": ["abort"]}, b"").args == ("abort",)
    for bad in ({"mode": ["later"]}, {"mode": ["wait", "abort"]}, {"x": ["1"]}):
        with pytest.raises(BadActionRequest):
            parse_checkpoint_prepare(bad, b"")
    with pytest.raises(BadActionRequest, match="no request body"):
        parse_checkpoint_prepare({}, b"{}")
    restore = parse_checkpoint_restore({}, b"")
    assert restore.check is not None and restore.check.holds(["running", None])
    assert restore.check.wanted() == "'restoring' or 'running'"
