"""Socket construction helpers over stub sockets and contexts: the options every socket
carries, the advertised address, the resource limits and the retry of an address in use (no
socket is opened or bound)."""

from __future__ import annotations

import errno
import resource
from typing import Any, cast

import pytest
import zmq

from exporter.client.enginecore import sockets
from exporter.client.enginecore.links import RECV_HWM, ZMQ_MAX_MSG_BYTES
from exporter.error import ConfigError


class StubSocket:
    """Records options and binds; reports the port a wildcard bind would get."""

    def __init__(self, port: int = 40123) -> None:
        self.options: dict[int, int] = {}
        self.bound: list[str] = []
        self.port = port

    def setsockopt(self, option: int, value: int) -> None:
        self.options[option] = value

    def bind(self, address: str) -> None:
        self.bound.append(address)

    def getsockopt_string(self, option: int) -> str:
        assert option == zmq.LAST_ENDPOINT
        host = self.bound[-1].rsplit(":", 1)[0]
        return f"{host}:{self.port}"


class StubContext:
    def __init__(self, max_sockets: int, limit: int) -> None:
        self.values: dict[int, int] = {zmq.MAX_SOCKETS: max_sockets, zmq.SOCKET_LIMIT: limit}

    def get(self, option: int) -> int:
        return self.values[option]

    def set(self, option: int, value: int) -> None:
        self.values[option] = value


def test_sizing_grows_with_the_engine_count_only_per_engine() -> None:
    assert sockets.sockets_needed(1000) == sockets.SOCKETS_BASE  # one shared PULL
    assert sockets.sockets_needed(10, per_engine=1) == 10 + sockets.SOCKETS_BASE
    assert sockets.descriptors_needed(100) == 100 * sockets.FDS_PER_ENGINE + sockets.FDS_BASE


def test_every_socket_is_dual_stack_bounded_and_never_blocks_a_send() -> None:
    sock = StubSocket()
    sockets.configure(cast(Any, sock), linger_ms=250)
    assert sock.options == {
        zmq.LINGER: 250,
        zmq.IPV6: 1,
        zmq.RCVHWM: RECV_HWM,
        zmq.SNDHWM: 0,
        zmq.MAXMSGSIZE: ZMQ_MAX_MSG_BYTES,
    }


@pytest.mark.parametrize(
    ("bind_host", "advertise", "port", "bound", "told"),
    [
        ("0.0.0.0", "10.0.0.5", None, "tcp://0.0.0.0:*", "tcp://10.0.0.5:40123"),
        ("::", "fd00::5", 7000, "tcp://[::]:7000", "tcp://[fd00::5]:40123"),
        ("[::1]", "[::1]", None, "tcp://[::1]:*", "tcp://[::1]:40123"),
    ],
)
def test_bind_tells_the_engines_the_advertised_host_and_the_bound_port(
    bind_host: str, advertise: str, port: int | None, bound: str, told: str
) -> None:
    sock = StubSocket()
    assert sockets.bind(cast(Any, sock), bind_host, advertise, port) == told
    assert sock.bound == [bound]


def test_the_socket_limit_is_raised_only_when_needed_and_possible() -> None:
    ctx = StubContext(max_sockets=1023, limit=65535)
    sockets.raise_max_sockets(cast(Any, ctx), 100)
    assert ctx.values[zmq.MAX_SOCKETS] == 1023  # never lowered
    sockets.raise_max_sockets(cast(Any, ctx), 5000)
    assert ctx.values[zmq.MAX_SOCKETS] == 5000
    with pytest.raises(ConfigError, match="above libzmq's limit of 65535"):
        sockets.raise_max_sockets(cast(Any, ctx), 70000)


def test_open_files_soft_limit_is_raised_to_the_hard_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda _, limits: set_to.append(limits))
    sockets.ensure_open_files(512)
    assert set_to == []
    sockets.ensure_open_files(2000)
    assert set_to == [(4096, 4096)]
    with pytest.raises(ConfigError, match="needs about 5000 open files but the limit is 1024"):
        sockets.ensure_open_files(5000)


async def test_an_address_in_use_is_retried_until_it_frees() -> None:
    """An exporter that just stopped can hold the fixed address for a moment."""
    attempts: list[int] = []

    def bind_once() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise zmq.ZMQError(errno.EADDRINUSE)
        return "tcp://127.0.0.1:5"

    assert await sockets.bind_when_free(bind_once, wait_s=5.0) == "tcp://127.0.0.1:5"
    assert len(attempts) == 3


async def test_other_bind_errors_and_a_lasting_conflict_are_raised() -> None:
    def no_such_host() -> str:
        raise zmq.ZMQError(errno.EINVAL)

    def always_in_use() -> str:
        raise zmq.ZMQError(errno.EADDRINUSE)

    with pytest.raises(zmq.ZMQError) as raised:
        await sockets.bind_when_free(no_such_host)
    assert raised.value.errno == errno.EINVAL
    with pytest.raises(zmq.ZMQError) as raised:
        await sockets.bind_when_free(always_in_use, wait_s=0.0)
    assert raised.value.errno == errno.EADDRINUSE
