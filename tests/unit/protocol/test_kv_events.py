"""Each engine's KV-events publisher from its registration (``exporter.protocol.kv_events``),
pure: vLLM's wire shape, its per-rank port offset and bind/connect rule, the target a consumer
connects to, and what a hostile registration gets (a refusal of that part only)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.error import ProtocolError
from exporter.protocol import decode_registration, encode_registration, registration_map
from exporter.protocol.kv_events import (
    DEFAULTS,
    KIND,
    MAX_ENDPOINT,
    MAX_TOPIC,
    endpoint_target,
    offset_endpoint_port,
    parse_kv_events_config,
    publisher_config,
    with_engine_host,
)

#: What vLLM 0.32's ``msgspec.msgpack.encode`` makes of DP rank 1's resolved ``KVEventsConfig``
#: (``ZmqEventPublisher`` with ``endpoint="tcp://*:5557"``, ``topic="kv"``), decoded: read with
#: vLLM's own classes (``vllm/config/kv_events.py``, ``vllm/distributed/kv_events.py``).
VLLM_RANK_1 = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://*:5558",
    "replay_endpoint": None,
    "buffer_steps": 10000,
    "hwm": 100000,
    "max_queue_size": 100000,
    "topic": "kv",
}


def source(endpoint: str, replay: str | None = None, host: str | None = None, **extra: Any) -> Any:
    config = {**VLLM_RANK_1, "endpoint": endpoint, "replay_endpoint": replay, **extra}
    found = parse_kv_events_config(config)
    assert found is not None
    return with_engine_host(found, host) if host is not None else found


def test_vllms_map_is_read_as_registered_and_the_wildcard_host_is_the_engines() -> None:
    found = parse_kv_events_config(VLLM_RANK_1)
    assert found is not None
    assert (found.publisher, found.endpoint, found.replay_endpoint, found.topic) == (
        "zmq",
        "tcp://*:5558",
        None,
        "kv",
    )
    assert found.target is None and found.note is not None and "unknown" in found.note
    resolved = with_engine_host(found, "10.0.0.5")
    assert (resolved.target, resolved.note, resolved.engine_host) == (
        "10.0.0.5:5558",
        None,
        "10.0.0.5",
    )


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (None, "no kv_events_config (events off: vLLM sends nil)"),
        ({**VLLM_RANK_1, "enable_kv_cache_events": False}, "events off"),
        ({**VLLM_RANK_1, "publisher": "null"}, "the null publisher"),
        ({"enable_kv_cache_events": False, "publisher": None}, "vLLM's defaults: off"),
    ],
)
def test_an_engine_without_a_publisher_has_none(config: Any, why: str) -> None:
    assert parse_kv_events_config(config) is None, why


def test_vllms_default_publisher_follows_enable_kv_cache_events() -> None:
    found = parse_kv_events_config({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})
    assert found is not None and found.publisher == "zmq" and found.topic == ""


@pytest.mark.parametrize(
    ("endpoint", "host", "target", "note"),
    [
        ("tcp://*:5557", "10.0.0.5", "10.0.0.5:5557", None),
        ("tcp://*:5557", "::ffff:10.0.0.5", "10.0.0.5:5557", None),  # a dual-stack socket's view
        ("tcp://*:5557", "::1", "[::1]:5557", None),
        ("tcp://[::]:5557", "fd00::7", "[fd00::7]:5557", None),
        ("tcp://[::1]:5559", None, "[::1]:5559", None),  # "::" in it: vLLM binds it as given
        ("tcp://node-3.example:5557", "10.0.0.5", None, "the engine connects"),
        ("tcp://10.0.0.7:5557", "10.0.0.5", None, "the engine connects"),
        # tcp://*:0 registers as the endpoint the engine bound: its own address, its port.
        ("tcp://10.0.0.5:41234", "10.0.0.5", "10.0.0.5:41234", None),
        ("tcp://127.0.0.1:41234", "::ffff:127.0.0.1", "127.0.0.1:41234", None),
        ("tcp://0.0.0.0:5557", "10.0.0.5", None, "the engine connects"),  # vLLM: not "*"
        ("tcp://*:0", "10.0.0.5", None, "no port"),  # unresolved: a real engine reports its port
        ("tcp://*:70000", "10.0.0.5", None, "no port"),
        ("tcp://*bad:5557", "10.0.0.5", None, "neither a name nor an address"),
        ("ipc:///tmp/kv.sock", "10.0.0.5", None, "ipc"),
        ("inproc://kv_dp1", "10.0.0.5", None, "inproc"),
        ("udp://*:5557", "10.0.0.5", None, "not a tcp"),
        ("tcp://*:5557", "not an address!", None, "unknown"),
    ],
)
def test_the_target_a_consumer_connects_to(
    endpoint: str, host: str | None, target: str | None, note: str | None
) -> None:
    found = source(endpoint, host=host)
    assert found.target == target
    if note is None:
        assert found.note is None
    else:
        assert found.note is not None and note in found.note, found.note


@pytest.mark.parametrize("port", ["\u00b2", "\u0665\u0665\u0665\u0667", "\uff15\uff15\uff15\uff17"])
def test_a_port_that_is_not_ascii_digits_is_no_port(port: str) -> None:
    """Ports are ASCII digits only: "²" passes ``str.isdigit`` and makes ``int()`` raise, 5557
    in Arabic-Indic or fullwidth digits reads as 5557. (A registration's endpoint is refused
    for its characters before this; the rule holds here on its own too.)"""
    assert endpoint_target(f"tcp://*:{port}", "zmq", "10.0.0.5") == (None, "no port to connect to")
    assert endpoint_target("tcp://*:5557", "zmq", "10.0.0.5") == ("10.0.0.5:5557", None)


def test_the_replay_endpoint_is_resolved_alike_and_its_problem_noted() -> None:
    both = source("tcp://*:5557", "tcp://*:5600", host="10.0.0.5")
    assert (both.target, both.replay_target, both.note) == ("10.0.0.5:5557", "10.0.0.5:5600", None)
    ipc_replay = source("tcp://*:5557", "ipc:///tmp/replay", host="10.0.0.5")
    assert ipc_replay.target == "10.0.0.5:5557" and ipc_replay.replay_target is None
    assert ipc_replay.note is not None and ipc_replay.note.startswith("replay: ")


def test_another_publisher_is_shown_without_a_target() -> None:
    found = source("tcp://*:5557", host="10.0.0.5", publisher="kafka")
    assert found.publisher == "kafka" and found.target is None
    assert found.note is not None and "kafka" in found.note


@pytest.mark.parametrize(
    ("config", "what"),
    [
        (["tcp://*:5557"], "not a map"),
        ("tcp://*:5557", "not a map"),
        ({**VLLM_RANK_1, "enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
        ({**VLLM_RANK_1, "publisher": 7}, "publisher"),
        ({**VLLM_RANK_1, "publisher": "p" * 65}, "publisher"),
        ({**VLLM_RANK_1, "endpoint": None}, "without an endpoint"),
        ({**VLLM_RANK_1, "endpoint": 5557}, "endpoint"),
        ({**VLLM_RANK_1, "endpoint": ""}, "endpoint"),
        ({**VLLM_RANK_1, "endpoint": "tcp://*:" + "5" * MAX_ENDPOINT}, "endpoint"),
        ({**VLLM_RANK_1, "endpoint": "tcp://*:5557\nX-Injected: 1"}, "characters"),
        ({**VLLM_RANK_1, "endpoint": "tcp://é:5557"}, "characters"),
        ({**VLLM_RANK_1, "replay_endpoint": ["tcp://*:5600"]}, "replay_endpoint"),
        ({**VLLM_RANK_1, "topic": 42}, "topic"),
        ({**VLLM_RANK_1, "topic": "t" * (MAX_TOPIC + 1)}, "topic"),
        ({**VLLM_RANK_1, "topic": "é" * (MAX_TOPIC // 2 + 1)}, "topic"),  # bytes, not characters
        ({**VLLM_RANK_1, "topic": "\ud800"}, "topic"),  # a lone surrogate (in-process only)
    ],
)
def test_hostile_values_refuse_the_publisher_with_one_kind(config: Any, what: str) -> None:
    with pytest.raises(ProtocolError) as caught:
        parse_kv_events_config(config)
    assert caught.value.kind == KIND and what in str(caught.value)
    assert len(str(caught.value)) < 200  # the message never echoes the value


def test_a_topic_with_any_text_within_its_bound_is_kept() -> None:
    topic = "é" * (MAX_TOPIC // 2)
    assert source("tcp://*:5557", topic=topic).topic == topic
    assert source("tcp://*:5557", topic=None).topic == ""


def test_a_registration_with_a_bad_kv_events_config_keeps_everything_else() -> None:
    fields = registration_map(1, vllm_version="0.33.0", kv_events_config={"endpoint": 5})
    fields["kv_events_config"] = ["not", "a", "map"]
    info = decode_registration(encode_registration(fields))
    assert info.vllm_version == "0.33.0" and info.enable_sleep_mode is True
    assert info.kv_events is None
    assert info.kv_events_error is not None and "not a map" in info.kv_events_error
    assert not info.kv_events_error.startswith(KIND)


# -- what an engine registers: vLLM's own rules, for simulators ---------------------------------


@pytest.mark.parametrize(
    ("endpoint", "rank", "expected"),
    [  # read with vLLM 0.32's ZmqEventPublisher.offset_endpoint_port
        ("tcp://*:5557", 0, "tcp://*:5557"),
        ("tcp://*:5557", 1, "tcp://*:5558"),
        ("tcp://[::1]:5557", 2, "tcp://[::1]:5559"),
        ("tcp://*:0", 3, "tcp://*:0"),
        ("inproc://x", 2, "inproc://x_dp2"),
        ("ipc:///tmp/x", 0, "ipc:///tmp/x"),
        (None, 4, None),
    ],
)
def test_the_port_is_offset_by_the_dp_rank_as_vllm_does(
    endpoint: str | None, rank: int, expected: str | None
) -> None:
    assert offset_endpoint_port(endpoint, rank) == expected


def test_an_ipc_publisher_beyond_rank_0_fails_as_in_vllm() -> None:
    with pytest.raises(ValueError, match="must contain 'inproc' or 'tcp'"):
        offset_endpoint_port("ipc:///tmp/x", 1)


def test_publisher_config_is_vllms_map_for_the_rank_round_trip() -> None:
    base = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv"}
    config = publisher_config(base, 1)
    assert config == VLLM_RANK_1 and list(config) == list(DEFAULTS)
    assert publisher_config(None, 1) is None
    assert publisher_config({"enable_kv_cache_events": False}, 1) is None
    assert publisher_config({"enable_kv_cache_events": True, "publisher": "null"}, 1) is None
    replay = publisher_config({**base, "replay_endpoint": "tcp://*:5600"}, 3)
    assert replay is not None and (replay["endpoint"], replay["replay_endpoint"]) == (
        "tcp://*:5560",
        "tcp://*:5603",
    )
    info = decode_registration(encode_registration(registration_map(1, kv_events_config=config)))
    assert info.kv_events is not None and info.kv_events.endpoint == "tcp://*:5558"
    assert info.kv_events_error is None
