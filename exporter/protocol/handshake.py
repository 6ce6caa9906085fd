"""Start-up handshake messages: HELLO / INIT / READY and the input-socket registration.

HELLO and READY are plain maps; INIT is ``EngineHandshakeMetadata``; the registration is the
``EngineCoreReadyResponse`` map an engine sends first on every input socket. The registration is
decoded as an untyped map so that the 28-key (0.33), 17-key, extra-key and empty (legacy) forms
are all accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from exporter.error import ProtocolError
from exporter.protocol.codec import decode, decode_any
from exporter.protocol.kv_events import KvEventsSource, parse_kv_events_config

HELLO = "HELLO"
READY = "READY"
#: An engine gives up (and its process fails) when no INIT arrives this long after its HELLO.
ENGINE_HANDSHAKE_TIMEOUT_S = 300.0
#: The relay drops a HELLO still queued for the front end a little before that, so a front end
#: that comes up late never receives a HELLO from an engine that has already given up.
RELAY_UPSTREAM_TIMEOUT_S = ENGINE_HANDSHAKE_TIMEOUT_S - 5.0


@dataclass(frozen=True, slots=True)
class HandshakeMessage:
    """A HELLO or READY message; ``extra`` keeps keys such as ``parallel_config_hash``."""

    status: str
    local: bool
    headless: bool
    extra: dict[str, Any] = field(default_factory=dict)


class EngineZmqAddresses(msgspec.Struct):
    """``addresses`` of INIT: one input and one output address per client slot."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None


class EngineHandshakeMetadata(msgspec.Struct):
    """INIT. Engines decode it strictly: ``parallel_config`` is required, values int|str|[int]."""

    addresses: EngineZmqAddresses
    parallel_config: dict[str, int | str | list[int]]


#: Registration strings end up in a label of every scrape: longer ones are cut to this.
MAX_REGISTRATION_STRING = 64
#: What the exporter keeps of an engine's registration (vLLM 0.33's ``EngineCoreReadyResponse``
#: keys, in its order), each with its type. vLLM 0.20 sends only ``max_model_len``,
#: ``num_gpu_blocks`` and ``dp_stats_address``; a key an engine does not send is absent from
#: ``RegistrationInfo.facts`` (``null`` in /status, ``unknown`` in a label). Nothing else of the
#: message is kept: it is up to a frame's size and comes from a peer.
REGISTRATION_FACTS: tuple[tuple[str, type], ...] = (
    ("max_model_len", int),
    ("num_gpu_blocks", int),
    ("block_size", int),
    ("dp_stats_address", str),
    ("dtype", str),
    ("vllm_version", str),
    ("world_size", int),
    ("data_parallel_size", int),
    ("tensor_parallel_size", int),
    ("pipeline_parallel_size", int),
    ("decode_context_parallel_size", int),
    ("data_parallel_rank", int),
    ("max_num_seqs", int),
    ("max_num_batched_tokens", int),
    ("instance_id", str),
    ("supports_lora", bool),
    ("max_loras", int),
    ("kv_cache_size_tokens", int),
    ("weight_transfer_backend", str),
    ("enable_sleep_mode", bool),
)


@dataclass(frozen=True, slots=True)
class RegistrationInfo:
    """What the exporter keeps from an engine's registration message (nothing else: the
    message is up to a frame's size and comes from a peer)."""

    vllm_version: str | None = None
    enable_sleep_mode: bool | None = None
    data_parallel_rank: int | None = None
    #: ``data_parallel_size`` > 1 means a coordinated (MoE) DP engine (dense DP reports 1).
    data_parallel_size: int | None = None
    #: The engine's KV-events publisher (``kv_events_config``); None: it publishes none.
    kv_events: KvEventsSource | None = None
    #: Why ``kv_events_config`` was refused (the rest of the registration still counts).
    kv_events_error: str | None = None
    #: The ``REGISTRATION_FACTS`` the engine sent with the right type, in that order.
    facts: tuple[tuple[str, Any], ...] = ()


_encoder = msgspec.msgpack.Encoder()
_init_decoder = msgspec.msgpack.Decoder(EngineHandshakeMetadata)


def engine_identity(engine_index: int) -> bytes:
    """ZMQ identity of DP rank ``engine_index``: two bytes, little endian."""
    if not 0 <= engine_index <= 0xFFFF:
        raise ValueError(f"engine index {engine_index} does not fit in two bytes")
    return engine_index.to_bytes(2, "little")


def identity_engine_index(identity: bytes) -> int | None:
    """Inverse of :func:`engine_identity`; None for identities that are not two bytes."""
    if len(identity) != 2:
        return None
    return int.from_bytes(identity, "little")


def _decode_map(payload: bytes, what: str) -> dict[str, Any]:
    obj = decode_any(payload, what)
    if not isinstance(obj, dict):
        raise ProtocolError("wrong_shape", f"{what} is not a map")
    return obj


def encode_handshake_message(
    status: str, *, local: bool = False, headless: bool = True, **extra: Any
) -> bytes:
    """Encode HELLO/READY with vLLM's key order: status, local, headless, then extras."""
    return _encoder.encode({"status": status, "local": local, "headless": headless, **extra})


def decode_handshake_message(payload: bytes) -> HandshakeMessage:
    """Decode HELLO/READY; raises ``ProtocolError`` for anything that is not such a map."""
    obj = _decode_map(payload, "handshake message")
    status = obj.get("status")
    if not isinstance(status, str):
        raise ProtocolError("wrong_shape", "handshake message has no string 'status'")
    local = obj.get("local", False)
    headless = obj.get("headless", False)
    if not isinstance(local, bool) or not isinstance(headless, bool):
        raise ProtocolError("wrong_type", "handshake 'local'/'headless' must be booleans")
    extra = {k: v for k, v in obj.items() if k not in ("status", "local", "headless")}
    return HandshakeMessage(status, local, headless, extra)


def encode_init(
    inputs: list[str], outputs: list[str], parallel_config: dict[str, Any] | None = None
) -> bytes:
    """Encode the minimal INIT (all five address keys, empty ``parallel_config``)."""
    return _encoder.encode(
        EngineHandshakeMetadata(
            EngineZmqAddresses(list(inputs), list(outputs)), dict(parallel_config or {})
        )
    )


def decode_init(payload: bytes) -> EngineHandshakeMetadata:
    """Decode INIT with the engine's strict rules (what a vLLM 0.33 engine accepts)."""
    return decode(payload, "INIT", _init_decoder)


def decode_registration(payload: bytes) -> RegistrationInfo:
    """Decode the registration frame; an empty frame (legacy engines) means "no info"."""
    if payload == b"":
        return RegistrationInfo()
    obj = _decode_map(payload, "registration message")
    version = obj.get("vllm_version")
    sleep_mode = obj.get("enable_sleep_mode")
    kv_events, kv_error = None, None
    try:
        kv_events = parse_kv_events_config(obj.get("kv_events_config"))
    except ProtocolError as exc:
        kv_error = str(exc).removeprefix(f"{exc.kind}: ")
    return RegistrationInfo(
        vllm_version=version[:MAX_REGISTRATION_STRING] if isinstance(version, str) else None,
        enable_sleep_mode=sleep_mode if isinstance(sleep_mode, bool) else None,
        data_parallel_rank=_int_or_none(obj.get("data_parallel_rank")),
        data_parallel_size=_int_or_none(obj.get("data_parallel_size")),
        kv_events=kv_events,
        kv_events_error=kv_error,
        facts=registration_facts(obj),
    )


def registration_facts(obj: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The known keys of a registration map, each of its type (strings cut); others dropped."""
    facts: list[tuple[str, Any]] = []
    for key, kind in REGISTRATION_FACTS:
        value = obj.get(key)
        if kind is bool:
            if isinstance(value, bool):
                facts.append((key, value))
        elif kind is int:
            if type(value) is int and -(2**63) <= value < 2**63:
                facts.append((key, value))
        elif isinstance(value, str):
            facts.append((key, value[:MAX_REGISTRATION_STRING]))
    return tuple(facts)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


#: The three keys vLLM 0.20 registers with (simulators of an older vLLM).
LEGACY_REGISTRATION_KEYS = ("max_model_len", "num_gpu_blocks", "dp_stats_address")


def registration_map(
    engine_index: int,
    *,
    vllm_version: str = "0.33.0",
    enable_sleep_mode: bool = True,
    data_parallel_size: int = 1,
    kv_events_config: dict[str, Any] | None = None,
    keys: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """A 28-key ``EngineCoreReadyResponse`` map in vLLM 0.33's field order (for simulators);
    ``kv_events_config`` as an engine publishing KV events sends it
    (``exporter.protocol.kv_events.publisher_config``); ``keys`` keeps only those (an older
    vLLM: ``LEGACY_REGISTRATION_KEYS`` for 0.20)."""
    full = _full_registration(
        engine_index, vllm_version, enable_sleep_mode, data_parallel_size, kv_events_config
    )
    if keys is None:
        return full
    return {k: v for k, v in full.items() if k in keys}


def _full_registration(
    engine_index: int,
    vllm_version: str,
    enable_sleep_mode: bool,
    data_parallel_size: int,
    kv_events_config: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "max_model_len": 4096,
        "num_gpu_blocks": 1000,
        "block_size": 16,
        "dp_stats_address": None,
        "dtype": "bfloat16",
        "vllm_version": vllm_version,
        "world_size": 1,
        "data_parallel_size": data_parallel_size,
        "tensor_parallel_size": 1,
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "data_parallel_rank": engine_index,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 8192,
        "instance_id": "abc",
        "supports_lora": False,
        "max_loras": 0,
        "mamba_block_size": None,
        "kv_cache_size_tokens": None,
        "kv_cache_max_concurrency": None,
        "kv_events_config": kv_events_config,
        "weight_transfer_backend": None,
        "enable_sleep_mode": enable_sleep_mode,
        "supports_draft_weight_updates": False,
        "effective_attention_block_size": None,
        "coord_store_port": 0,
        "coordinator_input_address": None,
        "coordinator_output_address": None,
    }


def encode_registration(fields: dict[str, Any]) -> bytes:
    """Encode a registration map (key order kept)."""
    return _encoder.encode(fields)
