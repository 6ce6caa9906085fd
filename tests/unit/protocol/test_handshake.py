"""HELLO / INIT / READY and the registration (``exporter.protocol.handshake``), against the
byte vectors of ``tests/data/engine-core.json``: an engine that cannot decode what the
exporter sends never starts, and whatever a peer sends ends as ``ProtocolError`` or a value."""

from __future__ import annotations

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol.handshake import (
    ENGINE_HANDSHAKE_TIMEOUT_S,
    LEGACY_REGISTRATION_KEYS,
    MAX_REGISTRATION_STRING,
    RELAY_UPSTREAM_TIMEOUT_S,
    decode_handshake_message,
    decode_init,
    decode_registration,
    encode_handshake_message,
    encode_init,
    encode_registration,
    engine_identity,
    identity_engine_index,
    registration_facts,
    registration_map,
)


def test_hello_and_ready_reproduce_the_vectors_and_round_trip(vectors: dict[str, bytes]) -> None:
    assert encode_handshake_message("HELLO") == vectors["hello_headless"]
    assert encode_handshake_message("READY", parallel_config_hash="abc") == vectors["ready_dp_hash"]
    hello = decode_handshake_message(vectors["hello_headless"])
    assert (hello.status, hello.local, hello.headless, hello.extra) == ("HELLO", False, True, {})


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ([1, 2], "wrong_shape"),
        ({"local": True}, "wrong_shape"),
        ({"status": 3}, "wrong_shape"),
        ({"status": "HELLO", "local": 1}, "wrong_type"),
        ({"status": "HELLO", "headless": "yes"}, "wrong_type"),
    ],
)
def test_a_handshake_message_of_another_shape_is_a_protocol_error(
    message: object, kind: str
) -> None:
    with pytest.raises(ProtocolError) as caught:
        decode_handshake_message(msgspec.msgpack.encode(message))
    assert caught.value.kind == kind


def test_init_reproduces_the_vector_and_decodes_both_forms(vectors: dict[str, bytes]) -> None:
    assert (
        encode_init(["tcp://127.0.0.1:5001"], ["tcp://127.0.0.1:5002"]) == vectors["init_minimal"]
    )
    for name in ("init_minimal", "init_minimal_omitted_optionals"):
        init = decode_init(vectors[name])
        assert init.addresses.outputs == ["tcp://127.0.0.1:5002"]
        assert init.addresses.frontend_stats_publish_address is None
    with pytest.raises(ProtocolError):
        decode_init(vectors["hello_headless"])  # a HELLO is no INIT


def test_identity_is_two_little_endian_bytes_and_back() -> None:
    assert engine_identity(0) == b"\x00\x00"
    assert engine_identity(258) == b"\x02\x01"
    assert identity_engine_index(engine_identity(0xFFFF)) == 0xFFFF
    assert identity_engine_index(b"\x01") is None
    assert identity_engine_index(b"\x01\x00\x00") is None
    for index in (-1, 0x10000):
        with pytest.raises(ValueError):
            engine_identity(index)


def test_the_registration_vector_yields_its_facts(vectors: dict[str, bytes]) -> None:
    info = decode_registration(vectors["ready_response_example"])
    assert (info.vllm_version, info.enable_sleep_mode) == ("0.33.0", False)
    assert (info.data_parallel_rank, info.data_parallel_size) == (1, 2)
    assert info.kv_events is None and info.kv_events_error is None
    facts = dict(info.facts)
    assert facts["dtype"] == "bfloat16" and facts["max_num_seqs"] == 256
    # None values (dp_stats_address, kv_cache_size_tokens) are facts not sent.
    assert "dp_stats_address" not in facts and "kv_cache_size_tokens" not in facts


def test_registration_facts_keep_only_known_keys_of_the_right_type_cut() -> None:
    facts = dict(
        registration_facts(
            {
                "vllm_version": "x" * 300,
                "max_model_len": True,  # a bool is not an int here
                "num_gpu_blocks": 2**63,  # out of int64
                "block_size": 16,
                "supports_lora": 1,  # an int is not a bool
                "enable_sleep_mode": True,
                "future_key": "kept nowhere",
            }
        )
    )
    assert facts == {
        "block_size": 16,
        "vllm_version": "x" * MAX_REGISTRATION_STRING,
        "enable_sleep_mode": True,
    }


def test_legacy_and_empty_registrations_are_accepted_a_bad_kv_config_noted() -> None:
    legacy = decode_registration(
        encode_registration(registration_map(3, keys=LEGACY_REGISTRATION_KEYS))
    )
    assert legacy.vllm_version is None and legacy.data_parallel_rank is None
    assert [k for k, _ in legacy.facts] == ["max_model_len", "num_gpu_blocks"]
    assert decode_registration(b"").facts == ()
    bad_kv = decode_registration(
        encode_registration({**registration_map(0), "kv_events_config": 7})
    )
    assert bad_kv.kv_events is None
    assert bad_kv.kv_events_error == "kv_events_config is int, not a map"  # no kind prefix
    assert bad_kv.vllm_version == "0.33.0"  # the rest still counts


def test_the_relay_gives_up_on_a_hello_before_the_engine_does() -> None:
    assert 0 < RELAY_UPSTREAM_TIMEOUT_S < ENGINE_HANDSHAKE_TIMEOUT_S
