"""Base URLs of an exporter: checked once, kept with their path prefix (the vLLM plugin serves
under ``/dp``), and joined with a route whatever slashes either side carries."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.error import ConfigError
from exporter.remote.urls import base_url, join


@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("http://h:19400", "http://h:19400"),
        ("http://h:19400///", "http://h:19400"),
        ("https://exporter.example/dp/", "https://exporter.example/dp"),
        ("http://[fe80::1]:8000/a/b", "http://[fe80::1]:8000/a/b"),
        ("http://h", "http://h"),  # no port: the scheme's
    ],
)
def test_a_usable_url_loses_only_its_trailing_slashes(url: str, kept: str) -> None:
    assert base_url(url) == kept


@pytest.mark.parametrize("value", [None, 19400, b"http://h:1"])
def test_a_url_that_is_not_a_string_names_what_it_was_for(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^admin URL: must be a non-empty string$"):
        base_url(value, "admin URL")


def test_the_default_name_is_url_and_the_message_quotes_the_url() -> None:
    with pytest.raises(ConfigError) as bad:
        base_url("tcp://h:1")
    assert str(bad.value) == "URL 'tcp://h:1': must start with http:// or https://"


def test_credentials_are_refused_without_echoing_them() -> None:
    """A URL ends up in logs and error messages: the password must not ride along."""
    for url in ("http://alice@h:1", "http://alice:s3cret@h:1", "http://:s3cret@h:1"):
        with pytest.raises(ConfigError) as bad:
            base_url(url)
        assert "s3cret" not in str(bad.value) and "alice" not in str(bad.value)


@pytest.mark.parametrize("url", ["http://h:port", "http://h:-1", "http://h:65536"])
def test_a_port_that_is_no_port(url: str) -> None:
    with pytest.raises(ConfigError, match="URL 'http://h:"):
        base_url(url)


@pytest.mark.parametrize(
    ("base", "route", "joined"),
    [
        ("http://h:1", "status", "http://h:1/status"),
        ("http://h:1", "///status", "http://h:1/status"),
        ("http://h:1/dp", "admin/sleep", "http://h:1/dp/admin/sleep"),
        ("http://h:1/dp", "/gate", "http://h:1/dp/gate"),
    ],
)
def test_join_puts_exactly_one_slash_between(base: str, route: str, joined: str) -> None:
    assert join(base, route) == joined
