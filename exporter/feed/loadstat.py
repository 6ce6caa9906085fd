"""What the ZMQ load publisher sends, in SGLang's per-rank load-publisher framing (pure).

Load-aware routers (llm-d's) already subscribe to SGLang's per-scheduler load publisher
(``sglang/srt/managers/scheduler_components/load_publisher.py``): one PUB socket per data-parallel
rank, rank ``r`` bound at ``BASE + r``, each message three frames ``[topic, seq, payload]`` with
``seq`` a big-endian signed 64-bit count per socket and topic, and ``payload`` a msgpack tagged
array-like struct. Publishing the same wire lets those routers read vLLM ranks unchanged.

Two topics share each socket:

* ``b"load"`` - :class:`LoadStat`, SGLang's struct field for field (tag first, 10 fields, no
  ``omit_defaults``: a router decodes it by position, so every field is always sent, 0 where the
  exporter does not know it);
* ``b"rank_state"`` - :class:`RankState`, the exporter's own: whether a router should send the
  rank traffic at all (``exporter.fleetstate.activity.routability``). Its topic must not start
  with ``b"load"``: a ZMQ subscription is a prefix match, and a router subscribed to ``b"load"``
  must receive nothing else. A router that subscribes to everything (SGLang says its load
  socket carries only load) receives it too: its tag is ``"RankState"``, never ``"LoadStat"``,
  so a decoder that checks the tag skips it.

Nothing here opens a socket (``exporter.feed.publisher`` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec

from exporter.feed.rows import GONE, reason_key
from exporter.fleetstate.activity import routability
from exporter.fleetstate.snapshot import EngineSnapshot
from exporter.protocol.activity import read_whole
from exporter.protocol.progress import MAX_TOKENS
from exporter.protocol.strings import ascii_digits

LOAD_TOPIC = b"load"
RANK_STATE_TOPIC = b"rank_state"
TOPICS = (LOAD_TOPIC, RANK_STATE_TOPIC)
#: The highest TCP port: a rank whose ``BASE + r`` is past it has no socket.
MAX_PORT = 65535
#: Why a rank that left the fleet is not routable (as ``/watch`` says it: ``rows.gone_row``).
GONE_REASON = "no longer part of the fleet"


class LoadStat(msgspec.Struct, array_like=True, tag="LoadStat", frozen=True, gc=False):
    """SGLang's ``LoadStat``: ``["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens,
    max_total_num_tokens, attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens,
    max_running_requests, total_prefill_uncached_tokens, total_prefill_busy_us]``. The first
    six are the stable prefix routers read; the rest were appended later (and are ignored by
    routers that predate them). Defaults only let an older, shorter message decode. The tag is
    spelled out: SGLang's is its class name (``tag=True``), which a rename here must not change."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int | None = None
    num_waiting_uncached_tokens: int = 0
    num_total_tokens: int = 0
    max_running_requests: int = 0
    total_prefill_uncached_tokens: int = 0
    total_prefill_busy_us: int = 0


class RankState(msgspec.Struct, array_like=True, tag="RankState", frozen=True, gc=False):
    """``["RankState", engine, routable, state, reasons]``: the rank's routable verdict, its
    state (``EngineSnapshot.state``, or ``gone``) and why it is not routable."""

    engine: str
    routable: bool
    state: str
    reasons: tuple[str, ...] = ()


class Frames(NamedTuple):
    """One decoded message: its topic, its sequence number and its payload."""

    topic: bytes
    seq: int
    message: LoadStat | RankState


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """What the exporter knows of one rank's load, in :class:`LoadStat`'s order (0: unknown)."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int
    max_running_requests: int

    def stat(self) -> LoadStat:
        return LoadStat(
            num_running_reqs=self.num_running_reqs,
            num_waiting_reqs=self.num_waiting_reqs,
            num_tokens=self.num_tokens,
            max_total_num_tokens=self.max_total_num_tokens,
            attn_dp_rank=self.attn_dp_rank,
            max_running_requests=self.max_running_requests,
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LoadStat | RankState)


def rank_of(engine: str) -> int | None:
    """The rank an engine label names: ASCII digits, no leading zero (so one label per port),
    at most :data:`MAX_PORT`; None for anything else (a target URL, ``"²"``, ``"-1"``, ``""``)."""
    if not ascii_digits(engine) or (len(engine) > 1 and engine[0] == "0"):
        return None
    if len(engine) > len(str(MAX_PORT)):
        return None
    rank = int(engine)
    return rank if rank <= MAX_PORT else None


def port_of(base: int, rank: int) -> int | None:
    """``base + rank``, or None when that is no TCP port."""
    port = base + rank
    return port if 0 < port <= MAX_PORT else None


def _whole(value: Any) -> int | None:
    return read_whole(value, MAX_TOKENS)


def kv_capacity(registration: Sequence[tuple[str, Any]]) -> int:
    """The rank's KV cache in tokens from its registration: ``kv_cache_size_tokens``, else
    ``num_gpu_blocks * block_size``, else 0 (unknown, as SGLang sends it)."""
    facts = dict(registration)
    size = _whole(facts.get("kv_cache_size_tokens"))
    if size is not None:
        return size
    blocks, block_size = _whole(facts.get("num_gpu_blocks")), _whole(facts.get("block_size"))
    if blocks is None or block_size is None:
        return 0
    return _whole(blocks * block_size) or 0


def load_of(e: EngineSnapshot, rank: int | None = None) -> LoadFigures:
    """What the exporter knows of ``e``'s load (``rank``: its rank; default: its label's).

    Running and waiting are vLLM's published request counts (0 while unknown: the attach mode
    cannot know them, or none arrived yet). The KV capacity and the running-request limit are
    the engine's registration facts. ``num_tokens`` (KV tokens in use) is always 0: vLLM's
    coordinator publishes each rank's KV usage, but the exporter keeps only its request counts.
    Everything SGLang appended after the first six fields is 0 too (no vLLM source).
    """
    rank = rank_of(e.engine) if rank is None else rank
    if rank is None:
        raise ValueError(f"engine {e.engine!r} is not a rank number")
    counts = e.requests
    facts = dict(e.detail.registration)
    return LoadFigures(
        num_running_reqs=0 if counts is None else counts.running,
        num_waiting_reqs=0 if counts is None else counts.waiting,
        num_tokens=0,
        max_total_num_tokens=kv_capacity(e.detail.registration),
        attn_dp_rank=rank,
        max_running_requests=_whole(facts.get("max_num_seqs")) or 0,
    )


def rank_state_of(e: EngineSnapshot) -> RankState:
    """``e``'s routable verdict as the ``rank_state`` topic sends it."""
    verdict = routability(e)
    return RankState(e.engine, verdict.routable, e.state, verdict.reasons)


def gone_state(engine: str) -> RankState:
    """The state of a rank that is no longer in the fleet: never routable."""
    return RankState(engine, False, GONE, (GONE_REASON,))


def rank_state_key(state: RankState) -> tuple[Any, ...]:
    """What a change of ``state`` is: its reasons without the seconds some carry (a hung rank
    is one change when it turns hung, not one per poll)."""
    return (state.routable, state.state, tuple(reason_key(r) for r in state.reasons))


def encode_frames(topic: bytes, seq: int, message: LoadStat | RankState) -> list[bytes]:
    """``[topic, seq as big-endian signed 64-bit, msgpack of message]``."""
    return [topic, seq.to_bytes(8, "big", signed=True), _encoder.encode(message)]


def decode_frames(frames: Sequence[bytes]) -> Frames:
    """One message as :func:`encode_frames` wrote it (ValueError: not one)."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise ValueError(f"not a [topic, seq, payload] message: {len(frames)} frames")
    topic, seq, payload = frames
    try:
        message = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"undecodable {bytes(topic)!r} payload: {exc}") from exc
    return Frames(bytes(topic), int.from_bytes(seq, "big", signed=True), message)
