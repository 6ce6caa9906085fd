"""The composition root (``exporter.control.attach``): the one place the attach mode is
compared, so each mode must get its own client and each mis-configuration a ``ConfigError``
before anything is bound; HTTP targets are parsed here too, and a bad one must never reach
the client (a token sent to a URL with credentials, two engines under one label)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.http.client import HttpFleetClient, HttpTarget
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.config.settings import ServeConfig, resolve_config
from exporter.control import attach
from exporter.control.attach import build_fleet, parse_target, parse_targets, relay_config
from exporter.error import ConfigError

ZMQ = {"engine_count": 2, "handshake_address": "tcp://127.0.0.1:1", "admin_listen": "off"}


def config(attach_mode: str, **settings: Any) -> ServeConfig:
    return resolve_config(None, environ={}, attach=attach_mode, admin_listen="off", **settings)


class StubCore:
    """vLLM's engine-core client as far as in-process mode checks it at construction."""

    def __init__(self) -> None:
        self.core_engines = [b"\x00\x00", b"\x01\x00"]
        self.utility_results: dict[int, Any] = {}
        self.resources = SimpleNamespace(engine_dead=False)
        self.engine_inflight: Counter[bytes] = Counter()

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        return False


def test_http_mode_gets_an_http_client_over_the_parsed_targets() -> None:
    client = build_fleet(
        config("http", http_target=("a=http://h:1/", "http://h:2")), ProtocolErrorTally()
    )
    assert isinstance(client, HttpFleetClient)
    assert client.targets == [HttpTarget("a", "http://h:1"), HttpTarget("1", "http://h:2")]
    assert client.engine_labels == ["a", "1"]


def test_owner_and_relay_modes_are_built_from_their_own_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        attach, "owner_client", lambda cfg, faults, **kw: built.append(("owner", cfg))
    )
    monkeypatch.setattr(
        attach, "relay_client", lambda cfg, faults, **kw: built.append(("relay", cfg))
    )
    build_fleet(resolve_config(None, environ={}, attach="owner", **ZMQ), ProtocolErrorTally())
    relay = resolve_config(
        None, environ={}, attach="relay", upstream_handshake_address="tcp://127.0.0.1:2", **ZMQ
    )
    build_fleet(relay, ProtocolErrorTally())
    assert [mode for mode, _ in built] == ["owner", "relay"]
    assert built[0][1].handshake_address == "tcp://127.0.0.1:1"
    assert built[0][1].engine_count == 2
    assert built[1][1].upstream_handshake_address == "tcp://127.0.0.1:2"
    assert built[1][1].upstream_timeout_s == relay.relay_upstream_timeout


def test_in_process_mode_needs_vllms_client_and_runs_over_it() -> None:
    inprocess = config("inprocess")
    with pytest.raises(ConfigError, match="runs inside vLLM's API server"):
        build_fleet(inprocess, ProtocolErrorTally())
    client = build_fleet(inprocess, ProtocolErrorTally(), vllm=VllmCore(StubCore()))
    assert isinstance(client, InProcessFleetClient)
    assert client.engine_labels == ["0", "1"]


def test_an_unknown_mode_and_a_relay_without_upstream_are_refused() -> None:
    owner = resolve_config(None, environ={}, attach="owner", **ZMQ)
    with pytest.raises(ConfigError, match="unknown attach mode 'carrier-pigeon'"):
        build_fleet(dataclasses.replace(owner, attach="carrier-pigeon"), ProtocolErrorTally())
    with pytest.raises(ConfigError, match="needs upstream_handshake_address"):
        relay_config(dataclasses.replace(owner, attach="relay", upstream_handshake_address=None))


@pytest.mark.parametrize(
    ("text", "label", "url"),
    [
        ("http://h:8000", "3", "http://h:8000"),
        (" b = https://h:8000/dp/ ", "b", "https://h:8000/dp"),
        ("node-1.x:2=http://[::1]:8000", "node-1.x:2", "http://[::1]:8000"),
        ("http://h:8000/p=q", "3", "http://h:8000/p=q"),  # '=' in the URL is no name
    ],
)
def test_a_target_is_url_or_name_equals_url(text: str, label: str, url: str) -> None:
    assert parse_target(text, 3) == HttpTarget(label, url)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a b=http://h:1", "a target name may only use"),
        ("=http://h:1", "a target name may only use"),
        ("ftp://h:1", "expected http://HOST:PORT"),
        ("h:8000", "expected http://HOST:PORT"),
        ("http://u:p@h:1", "credentials in the URL are not allowed"),
        ("http://h:1/?x=1", "takes no query or fragment"),
        ("http://h:1/#top", "takes no query or fragment"),
    ],
)
def test_a_bad_target_is_one_config_error(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_target(text, 0)


def test_targets_need_one_entry_and_unique_labels() -> None:
    with pytest.raises(ConfigError, match="at least one --http-target"):
        parse_targets([])
    with pytest.raises(ConfigError, match="label '0' is used twice"):
        parse_targets(["http://h:1", "0=http://h:2"])
    assert [t.label for t in parse_targets(["http://h:1", "x=http://h:2"])] == ["0", "x"]


def test_credentials_are_not_echoed_in_the_error() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_target("n=http://user:hunter2@h:1", 0)
    assert "hunter2" not in str(caught.value) and "--http-target n" in str(caught.value)
