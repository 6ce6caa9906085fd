"""``exporter/protocol/relay.py``: relay mode's one INIT rewrite. Byte-exactness against the
vectors, MoE configurations, unknown keys and every refusal are in
tests/unit/protocol/test_relay_rewrite.py; here: an INIT that already carries a relay's slot."""

from __future__ import annotations

from exporter.protocol import decode_init, encode_init
from exporter.protocol.relay import append_client_slot, strip_client_slot

FRONT_END = (
    ["tcp://10.0.0.1:5001", "tcp://10.0.0.2:5001"],
    ["tcp://10.0.0.1:5002", "tcp://10.0.0.2:5002"],
)


def test_a_second_relay_takes_the_next_slot_and_each_comes_off_again() -> None:
    original = encode_init(*FRONT_END)
    once, first = append_client_slot(original, "tcp://r1:1", "tcp://r1:2")
    twice, second = append_client_slot(once, "tcp://r2:1", "tcp://r2:2")
    assert (first, second) == (2, 3)
    addresses = decode_init(twice).addresses
    assert addresses.inputs == [*FRONT_END[0], "tcp://r1:1", "tcp://r2:1"]
    assert addresses.outputs == [*FRONT_END[1], "tcp://r1:2", "tcp://r2:2"]
    assert strip_client_slot(twice, second) == once
    assert strip_client_slot(once, first) == original


def test_the_rewrite_is_the_init_the_front_end_would_build_with_one_more_client() -> None:
    new, slot = append_client_slot(encode_init(*FRONT_END), "ipc:///tmp/in", "ipc:///tmp/out")
    assert slot == 2
    assert new == encode_init([*FRONT_END[0], "ipc:///tmp/in"], [*FRONT_END[1], "ipc:///tmp/out"])
