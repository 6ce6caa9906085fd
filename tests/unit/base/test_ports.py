"""Port helpers without binding anything: URL hosts, the ephemeral range, and the choice of
ports with the kernel's answers (``_bindable``, ``_kernel_port``) faked."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.base import ports
from exporter.base.ports import free_listen_port, free_port_range, url_host


@pytest.fixture(autouse=True)
def nothing_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with a process that handed out no port yet."""
    monkeypatch.setattr(ports, "_handed_out", set())


@pytest.mark.parametrize(
    ("host", "shown"),
    [
        ("127.0.0.1", "127.0.0.1"),
        ("localhost", "localhost"),
        ("::1", "[::1]"),
        ("fe80::1%eth0", "[fe80::1%eth0]"),
        ("[::1]", "[::1]"),  # already bracketed: not twice
    ],
)
def test_url_host_brackets_ipv6_only(host: str, shown: str) -> None:
    assert url_host(host) == shown


def test_the_address_family_follows_the_host() -> None:
    assert ports._family("127.0.0.1") == socket.AF_INET
    assert ports._family("::1") == socket.AF_INET6


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20000\t30000\n", (20000, 30000)), ("garbage", (32768, 60999)), (None, (32768, 60999))],
)
def test_the_ephemeral_range_falls_back_to_linuxs_default(
    monkeypatch: pytest.MonkeyPatch, text: str | None, expected: tuple[int, int]
) -> None:
    def read_text(self: Path, *args: object, **kwargs: object) -> str:
        if text is None:
            raise FileNotFoundError(self)
        return text

    monkeypatch.setattr(Path, "read_text", read_text)
    assert ports._ephemeral_range() == expected


def draws(monkeypatch: pytest.MonkeyPatch, values: list[int]) -> None:
    """``random.randrange`` answers ``values`` in turn (then the last one forever)."""
    it: Iterator[int] = iter(values)

    def randrange(low: int, high: int) -> int:
        return next(it, values[-1])

    monkeypatch.setattr(random, "randrange", randrange)


def test_a_listen_port_is_never_in_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handshake address dialled before it is bound must not be one the kernel hands out."""
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: port != 12000)
    draws(monkeypatch, [40000, 32768, 60999, 12000, 12001])
    assert free_listen_port() == 12001


def test_without_a_free_port_outside_the_range_the_kernel_chooses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (10000, 65535))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)
    monkeypatch.setattr(ports, "_kernel_port", lambda host: 45678)
    draws(monkeypatch, [20000])
    assert free_listen_port("::1") == 45678


def test_a_port_range_is_consecutive_free_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = {11002}
    bases = iter([11000, 11003])
    monkeypatch.setattr(ports, "free_listen_port", lambda host: next(bases))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: port not in taken)
    assert free_port_range(3) == 11003, "11000..11002 has a taken port"


def test_a_port_range_never_runs_past_65535(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "free_listen_port", lambda host: 65534)
    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)
    with pytest.raises(RuntimeError, match="no 3 consecutive free ports"):
        free_port_range(3)


def test_a_port_is_never_handed_out_twice_nor_one_of_a_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Picks made before anything binds them (a fixed base range, then a handshake port) never
    name the same port: the bind of the later one would fail with "Address already in use"."""
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)  # nothing is bound yet
    draws(monkeypatch, [11000, 11000, 11002, 11001, 11003, 11007])
    assert free_port_range(3) == 11000  # 11000..11002 handed out
    assert free_listen_port() == 11003  # 11000, 11002 and 11001 skipped
    assert free_listen_port() == 11007
    assert ports._handed_out == {11000, 11001, 11002, 11003, 11007}


def test_the_memory_of_handed_out_ports_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "MAX_REMEMBERED", 2)
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (32768, 60999))
    monkeypatch.setattr(ports, "_bindable", lambda host, port: True)
    draws(monkeypatch, [12000, 12001, 12002])
    assert [free_listen_port() for _ in range(3)] == [12000, 12001, 12002]
    assert ports._handed_out == {12002}  # forgotten all at once, then the newest kept
