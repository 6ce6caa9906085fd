"""``append_client_slot``: the only INIT rewrite, checked byte for byte against the vectors."""

from __future__ import annotations

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol import decode_init, encode_init
from exporter.protocol.relay import append_client_slot, strip_client_slot
from tests.harness.wire import vector

IN = "tcp://10.1.2.3:7001"
OUT = "tcp://10.1.2.3:7002"

MOE_PARALLEL_CONFIG = {
    "data_parallel_master_ip": "10.0.0.7",
    "data_parallel_master_port": 29500,
    "_data_parallel_master_port_list": [41001, 41002, 41003, 41004, 41005],
    "_coord_store_port": 47321,
    "data_parallel_size": 4,
}


def _pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def test_init_minimal_vector() -> None:
    original = vector("init_minimal")
    new, slot = append_client_slot(original, IN, OUT)
    assert slot == 1
    # Exactly the INIT the front end would have built with two client slots.
    assert new == encode_init(["tcp://127.0.0.1:5001", IN], ["tcp://127.0.0.1:5002", OUT])
    assert strip_client_slot(new, slot) == original
    init = decode_init(new)  # what the engine decodes
    assert init.addresses.inputs == ["tcp://127.0.0.1:5001", IN]
    assert init.addresses.outputs == ["tcp://127.0.0.1:5002", OUT]
    assert init.addresses.coordinator_input is None
    assert init.parallel_config == {}


def test_init_minimal_omitted_optionals_vector() -> None:
    original = vector("init_minimal_omitted_optionals")
    new, slot = append_client_slot(original, IN, OUT)
    assert slot == 1
    expected = _pack(
        {
            "addresses": {
                "inputs": ["tcp://127.0.0.1:5001", IN],
                "outputs": ["tcp://127.0.0.1:5002", OUT],
            },
            "parallel_config": {},
        }
    )
    assert new == expected
    assert strip_client_slot(new, slot) == original
    # Only the two arrays changed: header 91 → 92 and the appended strings.
    in_old = _pack(["tcp://127.0.0.1:5001"])
    in_new = _pack(["tcp://127.0.0.1:5001", IN])
    assert new == original.replace(in_old, in_new, 1).replace(
        _pack(["tcp://127.0.0.1:5002"]), _pack(["tcp://127.0.0.1:5002", OUT]), 1
    )


def test_moe_parallel_config_untouched() -> None:
    original = _pack(
        {
            "addresses": {
                "inputs": ["ipc:///tmp/a", "ipc:///tmp/b"],
                "outputs": ["ipc:///tmp/c", "ipc:///tmp/d"],
                "coordinator_input": "tcp://10.0.0.7:5555",
                "coordinator_output": "tcp://10.0.0.7:5556",
                "frontend_stats_publish_address": None,
            },
            "parallel_config": MOE_PARALLEL_CONFIG,
        }
    )
    new, slot = append_client_slot(original, IN, OUT)
    assert slot == 2  # len(original inputs), never hard-coded
    parallel_bytes = _pack(MOE_PARALLEL_CONFIG)
    assert new.endswith(b"\xafparallel_config" + parallel_bytes)
    assert original.endswith(b"\xafparallel_config" + parallel_bytes)
    assert strip_client_slot(new, slot) == original
    init = decode_init(new)
    assert init.parallel_config == MOE_PARALLEL_CONFIG
    assert init.addresses.inputs[-1] == IN and init.addresses.outputs[-1] == OUT
    assert init.addresses.coordinator_input == "tcp://10.0.0.7:5555"


def test_unknown_extra_keys_kept_in_order() -> None:
    original = _pack(
        {
            "zz_future": [1, 2],
            "addresses": {"inputs": ["a"], "outputs": ["b"], "new_key": "x"},
            "parallel_config": {"data_parallel_size": 2},
            "trailer": "t",
        }
    )
    new, slot = append_client_slot(original, IN, OUT)
    assert slot == 1
    assert strip_client_slot(new, slot) == original
    assert list(msgspec.msgpack.decode(new)) == [
        "zz_future",
        "addresses",
        "parallel_config",
        "trailer",
    ]


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        # a small int written as uint16: re-encoding would change the bytes
        (
            bytes.fromhex("82a961646472657373657382a6696e7075747391a161a76f75747075747391a162")
            + b"\xafparallel_config\x81\xb2data_parallel_size\xcd\x00\x02",
            "init_not_canonical",
        ),
        # a short string written as str8
        (
            bytes.fromhex("82a961646472657373657382a6696e7075747391d90161a76f75747075747391a162")
            + b"\xafparallel_config\x80",
            "init_not_canonical",
        ),
        (
            _pack({"addresses": {"inputs": ["a", "b"], "outputs": ["c"]}, "parallel_config": {}}),
            "init_slot_mismatch",
        ),
        (_pack({"addresses": {"inputs": ["a"], "outputs": ["b"]}}), "wrong_shape"),
        (_pack([["a"], ["b"]]), "wrong_shape"),
        (b"\xc1", "not_msgpack"),
        (
            _pack(
                {"addresses": {"inputs": ["a"], "outputs": ["b"]}, "parallel_config": {"x": 1.5}}
            ),
            "wrong_shape",
        ),
    ],
)
def test_refuses_what_it_cannot_rewrite_exactly(payload: bytes, kind: str) -> None:
    with pytest.raises(ProtocolError) as info:
        append_client_slot(payload, IN, OUT)
    assert info.value.kind == kind
