"""Every flag names a setting, and booleans read as operators write them."""

from __future__ import annotations

from dataclasses import fields

import pytest

from exporter.config.options import OPTIONS, parse_switch
from exporter.config.settings import ServeConfig, resolve_config
from exporter.error import ConfigError


def test_every_option_but_the_config_file_is_a_setting() -> None:
    names = {f.name for f in fields(ServeConfig)}
    assert {name for name, _, _ in OPTIONS} - names == {"config"}
    assert {"max_watchers", "load_publisher"} <= {name for name, _, _ in OPTIONS}


@pytest.mark.parametrize(("text", "value"), [("on", True), (" YES ", True), ("0", False)])
def test_switches(text: str, value: bool) -> None:
    assert parse_switch(text) is value


def test_anything_else_is_no_switch() -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_switch("maybe")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("udp://127.0.0.1:5557", "must be tcp://HOST:BASE"),
        ("127.0.0.1:5557", "must be tcp://HOST:BASE"),
        ("tcp://127.0.0.1", "must be HOST:PORT"),
        ("tcp://:5557", "must be HOST:PORT"),
        ("tcp://127.0.0.1:x", "is not a number"),
        ("tcp://127.0.0.1:70000", "out of range"),
        ("tcp://127.0.0.1:0", "at least 1"),
        ("x" * 10_000, "must be tcp://HOST:BASE"),
    ],
)
def test_a_load_publisher_that_is_not_tcp_host_base_is_refused_in_one_line(
    text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        resolve_config(attach="owner", engine_count=1, handshake_address="tcp://127.0.0.1:1",
                       load_publisher=text)  # fmt: skip
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 200


@pytest.mark.parametrize("bad", [-1, 1025])
def test_max_watchers_is_bounded(bad: int) -> None:
    with pytest.raises(ConfigError, match="--max-watchers must be at least 0 and at most 1024"):
        resolve_config(attach="owner", engine_count=1, handshake_address="tcp://127.0.0.1:1",
                       max_watchers=bad)  # fmt: skip
