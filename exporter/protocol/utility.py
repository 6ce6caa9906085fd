"""UTILITY requests and ``EngineCoreOutputs`` replies: wire structs and pure encode/decode.

Requests are ``[client_index, call_id, method, args]``; replies are a positional 9-element
``EngineCoreOutputs`` array whose position 4 is ``[call_id, failure_message, result]`` and whose
result is ``[type_info, value]`` (we use ``value`` and ignore ``type_info``: nothing named on the
wire is ever imported). Shorter and longer reply arrays are accepted, as vLLM's own decoder does:
elements after the 9 known positions (vLLM PR #51433's ``engine_notifications``, any later field)
are skipped unread, so an engine newer than the exporter never makes a protocol error.
"""

from __future__ import annotations

from typing import Any

import msgspec

from exporter.error import ProtocolError
from exporter.protocol.codec import decode
from exporter.protocol.strings import bound_text, bound_value

#: Request-type byte of a UTILITY request; the only type the exporter ever sends.
UTILITY_REQUEST_TYPE = b"\x03"
#: Single-frame sentinel an engine sends on every output socket before dying.
ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
UINT64_MAX = 2**64 - 1
#: Largest client_index the encoder packs. It indexes an engine's list of client output sockets
#: (one per API server, plus the exporter's): never more than a few, and an engine indexes it
#: unchecked, so anything larger is refused before it reaches the wire.
MAX_CLIENT_INDEX = 1023
#: The modes of vLLM's ``pause_scheduler`` and ``sleep``: one vocabulary for the admin actions'
#: parsers, the simulated engines and ``ctl``'s choices.
PAUSE_MODES = ("abort", "wait", "keep")


class UtilityRequest(msgspec.Struct, array_like=True, frozen=True):
    """UTILITY payload ``[client_index, call_id, method, args]``."""

    client_index: int
    call_id: int
    method: str
    args: tuple[Any, ...]


class UtilityOutputWire(msgspec.Struct, array_like=True):
    """``UtilityOutput``: ``[call_id, failure_message, result]`` (always 3 elements)."""

    call_id: int
    failure_message: str | None = None
    result: Any = None


#: Positions of vLLM 0.33's ``EngineCoreOutputs`` (the last, ``weight_version``, is 8).
KNOWN_OUTPUT_POSITIONS = 9


# On purpose: ``forbid_unknown_fields=False`` (msgspec's default, spelled out) makes an
# array-like struct skip every element after its last field without interpreting it, as vLLM's
# own client does. vLLM PR #51433 (not in 0.33) appends ``engine_notifications`` (position 9: a
# list of map-encoded notifications, or nil) and, since ``omit_defaults`` has no effect on an
# array-like struct, an engine with it sends 10 positions on every output. The exporter ignores
# the field; relay mode never touches an output (the front end gets the engine's bytes). A
# skipped element must still be well-formed msgpack within the nesting bound (``codec``).
# ``True`` here would make every such output a ``wrong_shape`` protocol error.
class EngineCoreOutputsWire(msgspec.Struct, array_like=True, forbid_unknown_fields=False):
    """``EngineCoreOutputs`` (9 positions in vLLM 0.33; shorter arrays take the defaults of the
    missing tail, longer ones have their trailing elements skipped)."""

    engine_index: int = 0
    outputs: list[Any] = msgspec.field(default_factory=list)
    scheduler_stats: Any = None
    timestamp: float = 0.0
    utility_output: UtilityOutputWire | None = None
    finished_requests: Any = None
    wave_complete: Any = None
    start_wave: Any = None
    weight_version: Any = None


class UtilityReply(msgspec.Struct, frozen=True):
    """One engine's answer to one utility call, with the result value unwrapped.

    This and ``EngineOutput`` are frozen Structs, not frozen dataclasses: one of each is built
    per engine per call, and a Struct costs a fraction of a frozen dataclass's ``__init__``
    (``python -m bench.hotpath``)."""

    call_id: int
    failure_message: str | None
    value: Any

    @property
    def ok(self) -> bool:
        return self.failure_message is None


class EngineOutput(msgspec.Struct, frozen=True):
    """A decoded output frame: ``utility`` is None for non-utility outputs. ``notice``: such an
    output whose only content follows the known positions (vLLM PR #51433 broadcasts its
    ``engine_notifications`` to every client so), nothing for the exporter and no error."""

    engine_index: int
    utility: UtilityReply | None
    notice: bool = False


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(UtilityRequest)
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputsWire)


def encode_utility_request(
    client_index: int, call_id: int, method: str, args: tuple[Any, ...] = ()
) -> bytes:
    """Encode a UTILITY payload frame (the frame after the type byte)."""
    if not 0 <= call_id <= UINT64_MAX:
        raise ValueError(f"call_id must be an unsigned 64-bit integer, got {call_id}")
    if type(client_index) is not int or not 0 <= client_index <= MAX_CLIENT_INDEX:
        raise ValueError(
            f"client_index must be an int in 0..{MAX_CLIENT_INDEX}, got {client_index!r}"
        )
    return _request_encoder.encode(UtilityRequest(client_index, call_id, method, tuple(args)))


def decode_utility_request(payload: bytes) -> UtilityRequest:
    """Decode a UTILITY payload (engine side); raises ``ProtocolError`` on anything else."""
    return decode(payload, "UTILITY payload", _request_decoder)


def unwrap_result(result: Any) -> Any:
    """``[type_info, value]`` → ``value``; nil → None. ``type_info`` is never interpreted."""
    if result is None:
        return None
    if isinstance(result, list) and len(result) == 2:
        return result[1]
    raise ProtocolError("wrong_shape", "utility result is not [type_info, value]")


def decode_engine_outputs(payload: bytes) -> EngineOutput:
    """Decode one ``EngineCoreOutputs`` frame; raises ``ProtocolError`` on malformed input.

    The failure text and every string of the result are cut here (``exporter.protocol.strings``),
    so nothing above sees more than ``MAX_ENGINE_STRING`` bytes of one engine string.
    """
    wire = decode(payload, "EngineCoreOutputs", _outputs_decoder)
    out = wire.utility_output
    if out is None:
        return EngineOutput(wire.engine_index, None, _only_trailing(payload, wire))
    if out.failure_message is not None:
        failure = bound_text(out.failure_message)
        return EngineOutput(wire.engine_index, UtilityReply(out.call_id, failure, None))
    value = bound_value(unwrap_result(out.result))
    return EngineOutput(wire.engine_index, UtilityReply(out.call_id, None, value))


class _Absent:
    """The type of ``ABSENT``: an argument not given (None is a value the wire carries)."""

    def __repr__(self) -> str:
        return "ABSENT"


#: ``encode_utility_reply(engine_notifications=ABSENT)``: no 10th position (vLLM 0.33).
ABSENT: Any = _Absent()


def _only_trailing(payload: bytes, wire: EngineCoreOutputsWire) -> bool:
    """True when an output without a utility reply has elements after the known positions and
    nothing in the known ones but its engine index, timestamp and weight version (which vLLM
    sets on every output of a step)."""
    return (
        _array_length(payload) > KNOWN_OUTPUT_POSITIONS
        and not wire.outputs
        and wire.scheduler_stats is None
        and wire.finished_requests is None
        and wire.wave_complete is None
        and wire.start_wave is None
    )


def _array_length(payload: bytes) -> int:
    """The element count in the header of ``payload``, a msgpack array (it decoded as one)."""
    head = payload[0]
    if head & 0xF0 == 0x90:  # fixarray
        return head & 0x0F
    size = 2 if head == 0xDC else 4  # array 16, array 32
    return int.from_bytes(payload[1 : 1 + size], "big")


def encode_utility_reply(
    engine_index: int,
    call_id: int,
    *,
    value: Any = None,
    failure_message: str | None = None,
    timestamp: float = 0.0,
    type_info: Any = None,
    engine_notifications: Any = ABSENT,
) -> bytes:
    """Encode a 9-position ``EngineCoreOutputs`` utility reply, as a vLLM 0.33 engine does.

    A success always carries ``[type_info, value]`` (``[nil, nil]`` for None): vLLM's Python
    client asserts the result is non-nil on success. ``engine_notifications`` (any value,
    None included) adds a 10th position as an engine with vLLM PR #51433 sends it: None when
    it has nothing to say, else a list of notifications (``custom_notification``).
    """
    result = None if failure_message is not None else [type_info, value]
    utility = [call_id, failure_message, result]
    fields = [engine_index, [], None, float(timestamp), utility, None, None, None, None]
    if engine_notifications is not ABSENT:
        fields.append(engine_notifications)
    return _request_encoder.encode(fields)


def encode_notifications_output(
    engine_index: int, engine_notifications: Any, *, timestamp: float = 0.0
) -> bytes:
    """An output with no utility reply that carries only ``engine_notifications`` (position 9),
    as an engine with vLLM PR #51433 broadcasts it to every client (simulators, tests)."""
    fields = [engine_index, [], None, float(timestamp), None, None, None, None, None]
    return _request_encoder.encode([*fields, engine_notifications])


def custom_notification(key: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """One entry of ``engine_notifications`` as vLLM PR #51433 encodes its ``CustomNotification``
    (``vllm/v1/notifications.py``: a tagged, map-encoded Struct with ``omit_defaults``, so an
    empty ``payload`` is left out): ``{"type": "custom", "key": ..., "payload": {...}}``.
    Simulators and tests only; the exporter never reads it."""
    entry: dict[str, Any] = {"type": "custom", "key": key}
    if payload:
        entry["payload"] = payload
    return entry


def reset_args(reset_running_requests: bool, reset_connector: bool) -> tuple[bool, ...]:
    """Both flags false → no arguments, which every vLLM version since 0.7 accepts."""
    if reset_connector:
        return (reset_running_requests, True)
    if reset_running_requests:
        return (True,)
    return ()
