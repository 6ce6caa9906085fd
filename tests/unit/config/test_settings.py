"""``exporter/config/settings.py``: ``ServeConfig`` from flags, environment, file and defaults,
checked as a whole (no subprocess). Precedence, bad values, bad config files and the admin
token rule are tests/integration/service/test_service_config.py; unsafe numbers and wrong
types tests/integration/resilience/test_operator_input.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from exporter.config.options import parse_switch
from exporter.config.settings import (
    ServeConfig,
    add_serve_arguments,
    is_loopback,
    parse_host_port,
    resolve_config,
    secret_file_warnings,
)
from exporter.error import ConfigError

OWNER: dict[str, Any] = {
    "engine_count": 2,
    "handshake_address": "tcp://127.0.0.1:5555",
    "admin_listen": "off",
}
HTTP: dict[str, Any] = {"attach": "http", "http_target": ("http://h:8000",), "admin_listen": "off"}


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def refused(**settings: Any) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, environ={}, **settings)
    return str(info.value)


@pytest.mark.parametrize("text", ["1", "TRUE", " yes ", "On"])
def test_switches_read_the_usual_words_for_true(text: str) -> None:
    assert parse_switch(text) is True


@pytest.mark.parametrize("text", ["0", "false", "No", "OFF"])
def test_switches_read_the_usual_words_for_false(text: str) -> None:
    assert parse_switch(text) is False


def test_a_switch_flag_alone_means_true_and_the_environment_may_say_off() -> None:
    config = resolve_config(flags("--relay-allow-state-changes"), environ={}, **OWNER)
    assert config.relay_allow_state_changes is True
    env = {"VLLM_DP_EXPORTER_RELAY_ALLOW_STATE_CHANGES": "off"}
    assert resolve_config(None, environ=env, **OWNER).relay_allow_state_changes is False
    bad = {"VLLM_DP_EXPORTER_RELAY_ALLOW_STATE_CHANGES": "maybe"}
    with pytest.raises(ConfigError, match="VLLM_DP_EXPORTER_RELAY_ALLOW_STATE_CHANGES='maybe'"):
        resolve_config(None, environ=bad, **OWNER)


def test_http_targets_repeat_as_flags_or_split_in_the_environment() -> None:
    args = flags("--attach", "http", "--http-target", "a=http://h:1", "--http-target", "http://h:2")
    assert resolve_config(args, environ={}, admin_listen="off").http_target == (
        "a=http://h:1",
        "http://h:2",
    )
    env = {"VLLM_DP_EXPORTER_HTTP_TARGET": "http://h:1, http://h:2 http://h:3"}
    config = resolve_config(None, environ=env, attach="http", admin_listen="off")
    assert config.http_target == ("http://h:1", "http://h:2", "http://h:3")


@pytest.mark.parametrize(
    ("text", "host_port"),
    [("0.0.0.0:19400", ("0.0.0.0", 19400)), ("[::1]:9", ("::1", 9)), ("h:0", ("h", 0))],
)
def test_listen_addresses_are_host_and_port(text: str, host_port: tuple[str, int]) -> None:
    assert parse_host_port(text, "listen") == host_port


@pytest.mark.parametrize("text", [":9", "h", "h:-1", "h:65536", "h:"])
def test_listen_addresses_without_a_host_or_a_port_in_range_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--listen"):
        parse_host_port(text, "listen")


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("localhost", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("localhost.example.com", False),
    ],
)
def test_which_admin_hosts_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("off", ["off", "none", ""])
def test_the_admin_listener_can_be_switched_off(off: str) -> None:
    assert (
        resolve_config(None, environ={}, **{**OWNER, "admin_listen": off}).admin_host_port is None
    )


def test_how_the_settings_fit_together_in_each_mode() -> None:
    too_many = refused(**OWNER | {"start_rank": 65535, "engine_count": 2})
    assert too_many.startswith("--start-rank/--engine-count")
    assert refused(**OWNER | {"attach": "relay"}) == (
        "--attach relay needs --upstream-handshake-address"
    )
    assert refused(attach="http", admin_listen="off") == (
        "--attach http needs --http-target URL or --http-targets-file"
    )
    # HTTP mode needs no engine count or handshake address; owner mode needs no target.
    assert resolve_config(None, environ={}, **HTTP).engine_count == 0


def test_the_http_files_are_read_once_in_http_mode_and_ignored_elsewhere(tmp_path: Path) -> None:
    targets = tmp_path / "targets"
    targets.write_text("# fleet\nhttp://a:1\nb=http://b:2\n")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    config = resolve_config(
        None,
        environ={},
        attach="http",
        admin_listen="off",
        http_targets_file=str(targets),
        http_token_file=str(token),
    )
    assert config.http_file_targets == ("http://a:1", "b=http://b:2")
    assert config.http_token == "s3cret" and "s3cret" not in repr(config)
    missing = str(tmp_path / "missing")
    owner = resolve_config(
        None, environ={}, **OWNER, http_targets_file=missing, http_token_file=missing
    )
    assert owner.http_file_targets == () and owner.http_token is None


def test_an_http_token_file_is_warned_about_only_in_http_mode(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    os.chmod(token, 0o644)
    http = ServeConfig(attach="http", http_token_file=str(token), admin_token_file=str(token))
    assert [w.split(" ", 1)[0] for w in secret_file_warnings(http)] == [
        "--admin-token-file",
        "--http-token-file",
    ]
    owner = ServeConfig(attach="owner", http_token_file=str(token))
    assert secret_file_warnings(owner) == []


def test_log_and_event_loop_settings_are_checked_and_normalised() -> None:
    config = resolve_config(None, environ={}, **OWNER, log_level="WARNING", event_loop="AsyncIO")
    assert (config.log_level, config.event_loop) == ("warning", "asyncio")
    assert refused(**OWNER, log_level="verbose").startswith("--log-level")
    assert refused(**OWNER, log_format="xml").startswith("--log-format")
    assert refused(**OWNER, event_loop="trio").startswith("--event-loop")


def test_the_fleet_shape_carries_what_owner_and_relay_mode_bind() -> None:
    config = resolve_config(None, environ={}, **OWNER, start_rank=4, fixed_base_port=30000)
    assert config.fleet_shape() == {
        "engine_count": 2,
        "start_rank": 4,
        "advertise_host": "127.0.0.1",
        "bind_host": None,
        "fixed_base_port": 30000,
        "state_file": None,
    }


@pytest.mark.skipif(sys.version_info < (3, 11), reason="TOML config files need Python 3.11+")
def test_a_toml_config_file_is_read_like_a_json_one(tmp_path: Path) -> None:
    path = tmp_path / "exporter.toml"
    path.write_text('poll-interval = 0.5\nhttp_target = ["http://h:1"]\nattach = "http"\n')
    config = resolve_config(None, environ={}, config=str(path), admin_listen="off")
    assert (config.poll_interval, config.http_target) == (0.5, ("http://h:1",))
    path.write_text("poll_interval = \n")
    assert refused(config=str(path)).startswith(f"config file {path}:")
