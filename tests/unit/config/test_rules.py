"""``exporter/config/rules.py``: the bounds and type checks every setting goes through (pure),
and the operator-file helpers that need no subprocess. The settings' own messages through
``resolve_config`` are tests/integration/service/test_service_config.py and
tests/integration/resilience/test_operator_input.py; file sizes and encodings
tests/unit/config/test_operator_files.py."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from exporter.config.rules import (
    BOUNDS,
    Bound,
    check_bounds,
    check_type,
    flag,
    no_passphrase,
    open_to_everyone,
    split_targets,
    target_lines,
    unknown_env,
)
from exporter.error import ConfigError


@pytest.mark.parametrize(
    ("bound", "inside", "outside"),
    [
        (Bound(0, 1), (0.0, 1.0), (-0.001, 1.001)),
        (Bound(0, 1, low_open=True), (0.001, 1.0), (0.0,)),
        (Bound(0, 1, high_open=True), (0.0, 0.999), (1.0,)),
        (Bound(0, 1e9), (1e9,), (math.nan, math.inf, -math.inf)),
    ],
)
def test_a_bound_holds_its_ends_as_marked_and_never_a_non_finite_number(
    bound: Bound, inside: tuple[float, ...], outside: tuple[float, ...]
) -> None:
    assert all(bound.holds(v) for v in inside)
    assert not any(bound.holds(v) for v in outside)


def test_a_bound_describes_its_ends_and_why() -> None:
    assert Bound(0, 86400, low_open=True).describe() == "greater than 0 and at most 86400"
    assert Bound(0, 1, high_open=True).describe() == "at least 0 and less than 1"
    assert BOUNDS["relay_upstream_timeout"].describe() == (
        "greater than 0 and at most 300 (engines wait 5 minutes)"
    )


def test_unset_settings_are_not_checked_and_the_first_violation_names_its_flag() -> None:
    check_bounds({"reset_timeout": None, "poll_interval": 5.0})
    with pytest.raises(ConfigError) as info:
        check_bounds({"gate_min_interval": 61.0})
    assert str(info.value) == "--gate-min-interval must be at least 0 and at most 60, got 61.0"
    assert flag("verify_weights_timeout") == "--verify-weights-timeout"


@pytest.mark.parametrize("bad", [-1.0, 86401.0, math.nan, math.inf])
def test_stall_after_is_a_day_at_most_and_never_negative_or_non_finite(bad: float) -> None:
    check_bounds({"stall_after": 0.0})  # 0: never stalled
    check_bounds({"stall_after": 86400.0})
    with pytest.raises(ConfigError, match="--stall-after must be at least 0 and at most 86400"):
        check_bounds({"stall_after": bad})


@pytest.mark.parametrize(
    ("value", "hint", "result"),
    [
        (3, float, 3.0),
        (2.5, float, 2.5),
        (3, int, 3),
        ("x", str, "x"),
        (True, bool, True),
        (None, int | None, None),
        (7, int | None, 7),
        ("a, b  c", tuple[str, ...], ("a", "b", "c")),
        (["a", "b"], tuple[str, ...], ("a", "b")),
    ],
)
def test_values_become_the_settings_type(value: Any, hint: Any, result: Any) -> None:
    checked = check_type("--x", value, hint)
    assert checked == result and type(checked) is type(result)


@pytest.mark.parametrize(
    ("value", "hint", "message"),
    [
        (True, int, "--x must be an integer, got a boolean true"),
        (True, float, "--x must be a number, got a boolean true"),
        (1, bool, "--x must be a boolean, got an integer 1"),
        (None, str, "--x must be a string, got null"),
        ("5", int | None, '--x must be an integer or null, got a string "5"'),
        (
            {"a": 1},
            tuple[str, ...],
            "--x must be a string or a list of strings, got a table/object",
        ),
        ("x" * 100, int, '--x must be an integer, got a string "' + "x" * 36 + "..."),
    ],
)
def test_a_value_of_another_type_is_named_with_what_was_given(
    value: Any, hint: Any, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_type("--x", value, hint)
    assert str(info.value).startswith(message)


def test_a_value_nested_too_deeply_to_show_is_named_by_its_kind() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError, match="got an array nested too deeply"):
        check_type("--x", deep, int)


def test_targets_are_split_on_commas_and_whitespace_and_files_skip_comments() -> None:
    assert split_targets(" a,b\tc ,, d\n") == ["a", "b", "c", "d"]
    text = "# the targets\nhttp://a:1  # first\n\n   \nb=http://b:2\n#http://c:3\n"
    assert target_lines(text) == ("http://a:1", "b=http://b:2")


def test_an_unknown_variable_is_named_with_a_likely_spelling_only_when_there_is_one() -> None:
    env = {"APP_LISTEN": "x", "APP_LISTN": "x", "APP_ZZZ": "x", "OTHER_LISTN": "x"}
    assert unknown_env(env, "APP_", ["listen", "poll_interval"]) == [
        "ignoring unknown environment variable APP_LISTN; did you mean APP_LISTEN?",
        "ignoring unknown environment variable APP_ZZZ",
    ]


@pytest.mark.parametrize(
    ("mode", "warned"),
    [(0o600, False), (0o640, False), (0o440, False), (0o604, True), (0o602, True)],
)
def test_a_secret_file_every_user_can_read_or_write_is_warned_about(
    tmp_path: Path, mode: int, warned: bool
) -> None:
    secret = tmp_path / "token"
    secret.write_text("t")
    os.chmod(secret, mode)
    warning = open_to_everyone(str(secret), "--admin-token-file")
    assert (warning is not None) is warned
    if warning:
        assert f"mode {mode:04o}" in warning and str(secret) in warning
    assert open_to_everyone(str(tmp_path / "missing"), "--admin-token-file") is None


def test_an_encrypted_key_is_refused_instead_of_prompting() -> None:
    with pytest.raises(ConfigError, match="--web-config-file key_file is encrypted"):
        no_passphrase("--web-config-file key_file")()
