"""The ZMQ load publisher's wire (pure): SGLang's LoadStat byte shape, decoded both as plain
msgpack and with a copy of SGLang's own struct; what the exporter knows of a rank's load; the
rank_state topic; hostile engine labels and ports past 65535 refused, never a crash."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import msgspec
import pytest

from exporter.client.fleet import EngineDetail
from exporter.feed.loadstat import (
    LOAD_TOPIC,
    RANK_STATE_TOPIC,
    LoadStat,
    RankState,
    decode_frames,
    encode_frames,
    gone_state,
    kv_capacity,
    load_of,
    port_of,
    rank_of,
    rank_state_key,
    rank_state_of,
)
from exporter.feed.publisher import LoadPublisher
from exporter.protocol.activity import RequestCounts
from tests.harness.snapshots import engine_snapshot, polled

AWAKE: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False, "has_work": True}
HOSTILE_LABELS = ("²", "\u0661", "-1", "", "99999999999", " 1", "1.0", "01", "http://h:8000")


class SglangLoadStat(
    msgspec.Struct,
    array_like=True,
    gc=False,
    tag="LoadStat",  # SGLang's tag=True: its class name, LoadStat
):
    """SGLang 0.5.23's LoadStat, field order and defaults as it declares them."""

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


def detail(name: str, **kw: Any) -> EngineDetail:
    return EngineDetail(name, True, f"fake://{name}", **kw)


def test_load_payload_is_sglangs_tagged_array_of_ten_fields() -> None:
    stat = LoadStat(4, 2, 0, 8192, attn_dp_rank=3, max_running_requests=256)
    frames = encode_frames(LOAD_TOPIC, 7, stat)
    assert frames[0] == b"load"
    assert frames[1] == b"\x00\x00\x00\x00\x00\x00\x00\x07"
    plain = msgspec.msgpack.decode(frames[2])
    assert plain == ["LoadStat", 4, 2, 0, 8192, 3, 0, 0, 256, 0, 0]
    theirs = msgspec.msgpack.Decoder(type=SglangLoadStat).decode(frames[2])
    assert theirs == SglangLoadStat(
        num_running_reqs=4,
        num_waiting_reqs=2,
        num_tokens=0,
        max_total_num_tokens=8192,
        attn_dp_rank=3,
        max_running_requests=256,
    )


def test_an_sglang_message_decodes_with_ours_and_seq_is_signed_big_endian() -> None:
    payload = msgspec.msgpack.encode(SglangLoadStat(1, 0, 5, 100, 2, 1, 2, 3, 4, 5))
    found = decode_frames([b"load", (2**40).to_bytes(8, "big"), payload])
    assert found.seq == 2**40 and found.topic == b"load"
    assert found.message == LoadStat(1, 0, 5, 100, 2, 1, 2, 3, 4, 5)
    assert encode_frames(LOAD_TOPIC, -1, found.message)[1] == b"\xff" * 8
    with pytest.raises(ValueError):
        decode_frames([b"load", b"\x00" * 8])
    with pytest.raises(ValueError):
        decode_frames([b"load", b"\x00" * 8, msgspec.msgpack.encode(["Other", 1])])


def test_rank_state_topic_is_no_prefix_match_of_load_and_decodes() -> None:
    assert not RANK_STATE_TOPIC.startswith(LOAD_TOPIC)
    assert not LOAD_TOPIC.startswith(RANK_STATE_TOPIC)
    state = RankState("2", False, "paused", ("paused",))
    frames = encode_frames(RANK_STATE_TOPIC, 0, state)
    assert msgspec.msgpack.decode(frames[2]) == ["RankState", "2", False, "paused", ["paused"]]
    assert decode_frames(frames).message == state


def test_figures_from_a_snapshot() -> None:
    facts = (("num_gpu_blocks", 100), ("block_size", 16), ("max_num_seqs", 64))
    e = engine_snapshot("3", detail("3", requests=RequestCounts(5, 7), registration=facts))
    figures = load_of(e)
    assert (figures.num_running_reqs, figures.num_waiting_reqs) == (5, 7)
    assert (figures.max_total_num_tokens, figures.max_running_requests) == (1600, 64)
    assert (figures.num_tokens, figures.attn_dp_rank) == (0, 3)
    stat = figures.stat()
    assert msgspec.msgpack.decode(encode_frames(LOAD_TOPIC, 0, stat)[2]) == [
        "LoadStat", 5, 7, 0, 1600, 3, 0, 0, 64, 0, 0
    ]  # fmt: skip


def test_unknown_figures_are_zero_and_kv_size_wins_over_blocks() -> None:
    bare = load_of(engine_snapshot("0"))
    assert (bare.num_running_reqs, bare.max_total_num_tokens, bare.max_running_requests) == (
        0,
        0,
        0,
    )
    assert kv_capacity((("kv_cache_size_tokens", 5000), ("num_gpu_blocks", 1))) == 5000
    assert kv_capacity((("num_gpu_blocks", 10),)) == 0
    assert (
        kv_capacity((("kv_cache_size_tokens", -5), ("num_gpu_blocks", 2), ("block_size", 3))) == 6
    )
    huge = (("num_gpu_blocks", 2**62), ("block_size", 2**62))
    assert kv_capacity(huge) == 0  # no product past what a router's i64 holds
    with pytest.raises(ValueError):
        load_of(engine_snapshot("http://h:8000"))


def test_rank_state_from_routability_and_a_duration_is_no_change() -> None:
    awake = engine_snapshot("1", **AWAKE)
    assert rank_state_of(awake) == RankState("1", True, "awake", ())
    paused = rank_state_of(engine_snapshot("1", **{**AWAKE, "is_scheduler_paused": True}))
    assert paused == RankState("1", False, "paused", ("paused",))
    hung_1 = rank_state_of(dataclasses.replace(awake, hung=True, unresponsive_s=1.0))
    hung_9 = rank_state_of(dataclasses.replace(awake, hung=True, unresponsive_s=9.0))
    assert hung_1 != hung_9 and rank_state_key(hung_1) == rank_state_key(hung_9)
    assert rank_state_key(hung_1) != rank_state_key(rank_state_of(awake))
    assert gone_state("4") == RankState("4", False, "gone", ("no longer part of the fleet",))


@pytest.mark.parametrize("label", HOSTILE_LABELS)
def test_hostile_labels_are_no_rank(label: str) -> None:
    assert rank_of(label) is None


def test_ranks_and_ports() -> None:
    assert [rank_of(x) for x in ("0", "7", "65535")] == [0, 7, 65535]
    assert rank_of("65536") is None
    assert port_of(5557, 3) == 5560
    assert port_of(65535, 1) is None


def test_hostile_labels_are_skipped_by_the_publisher() -> None:
    pub = LoadPublisher("127.0.0.1", 40000)
    pub.publish(polled(*(engine_snapshot(x, **AWAKE) for x in HOSTILE_LABELS)))
    assert pub.status_json()["endpoints"] == []
    assert pub.figures()["vllm_dp_load_bind_failures_total"] == {(): 0.0}
    pub.close()


def test_a_port_past_65535_is_a_recorded_error(caplog: pytest.LogCaptureFixture) -> None:
    pub = LoadPublisher("127.0.0.1", 65535)
    snap = polled(engine_snapshot("1", **AWAKE))
    with caplog.at_level(logging.WARNING, logger="exporter.feed"):
        pub.publish(snap)
        pub.publish(snap)
    [entry] = pub.status_json()["endpoints"]
    assert entry["engine"] == "1" and entry["bound"] is False
    assert entry["endpoint"] == "tcp://127.0.0.1:65536" and "past 65535" in entry["error"]
    assert pub.figures()["vllm_dp_load_bind_failures_total"] == {(): 1.0}
    assert len([r for r in caplog.records if "65536" in r.getMessage()]) == 1
    pub.close()


def test_a_base_port_that_is_no_port_is_refused() -> None:
    for base in (0, -1, 65536):
        with pytest.raises(ValueError):
            LoadPublisher("127.0.0.1", base)
