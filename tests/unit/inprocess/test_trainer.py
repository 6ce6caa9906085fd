"""The trainer's entry point (``exporter.inprocess.trainer``): its settings are checked before
anything starts, since ``resolve_config`` would silently ignore a misspelt keyword, and a
trainer's exporter must be in-process mode whatever the environment says."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from exporter.config.settings import DERIVED
from exporter.error import ConfigError
from exporter.inprocess import trainer
from exporter.inprocess.trainer import SETTING_NAMES, inprocess_config, start_exporter

ENV = "VLLM_DP_EXPORTER_"


def test_a_misspelt_or_derived_setting_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"unknown setting 'pol_interval'"):
        inprocess_config({}, pol_interval=1.0)
    with pytest.raises(ConfigError, match=r"unknown setting 'admin_token', 'http_token'"):
        inprocess_config({}, http_token="x", admin_token="y")  # derived: read from files only


def test_the_names_are_the_configs_fields_and_config() -> None:
    assert "poll_interval" in SETTING_NAMES and "config" in SETTING_NAMES
    assert not SETTING_NAMES & DERIVED


def test_the_mode_is_in_process_whatever_the_environment_says() -> None:
    config = inprocess_config({ENV + "ATTACH": "owner"}, admin_listen="off")
    assert config.attach == "inprocess"


def test_keywords_win_over_the_environment_which_wins_over_defaults() -> None:
    env = {ENV + "POLL_INTERVAL": "3", ENV + "CALL_TIMEOUT": "0.5"}
    config = inprocess_config(env, poll_interval=1.5, admin_listen="off")
    assert config.poll_interval == 1.5
    assert config.call_timeout == 0.5
    with pytest.raises(ConfigError, match=ENV + "POLL_INTERVAL"):
        inprocess_config({ENV + "POLL_INTERVAL": "soon"}, admin_listen="off")


async def test_a_bad_setting_fails_the_start_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[object] = []

    async def start_service(*args: object) -> None:
        started.append(args)

    monkeypatch.setattr(trainer, "start_service", start_service)
    with pytest.raises(ConfigError, match="unknown setting 'listen_adress'"):
        await start_exporter(SimpleNamespace(), environ={}, listen_adress="x")
    assert started == []


async def test_listen_addresses_default_to_loopback_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer's process is no public server: loopback unless told otherwise."""
    seen: list[tuple[str, str]] = []

    def config_of(env: object, **settings: object) -> object:
        seen.append((str(settings["listen"]), str(settings["admin_listen"])))
        raise ConfigError("stop here")

    monkeypatch.setattr(trainer, "inprocess_config", config_of)
    for environ in ({}, {ENV + "LISTEN": "0.0.0.0:1", ENV + "ADMIN_LISTEN": "off"}):
        with pytest.raises(ConfigError):
            await start_exporter(SimpleNamespace(), environ=environ)
    with pytest.raises(ConfigError):
        await start_exporter(
            SimpleNamespace(), environ={}, listen="127.0.0.1:0", admin_listen="off"
        )
    assert seen == [
        ("127.0.0.1:19400", "127.0.0.1:19401"),
        ("0.0.0.0:1", "off"),
        ("127.0.0.1:0", "off"),
    ]
