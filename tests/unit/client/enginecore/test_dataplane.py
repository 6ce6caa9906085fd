"""``EngineDataPlane``'s decisions over a stub context (nothing is bound): when a handshaken
engine is up or refused, which registrations are believed, death, and what the state file gets."""

from __future__ import annotations

from typing import Any, cast

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.dataplane import EngineDataPlane
from exporter.client.enginecore.links import EngineLink, FleetShape, Phase
from exporter.error import EngineUnavailable, ProtocolError
from exporter.protocol import encode_registration, engine_identity, registration_map
from exporter.protocol.kv_events import publisher_config
from exporter.protocol.pushes import FaultStatus


class Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []

    def on_output(self, engine_index: int, output: object) -> bool:
        return False

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        self.calls.append(("down", engine_index, reason))

    def on_engine_hello(self, engine_index: int) -> None:
        return None

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        self.calls.append(("up", engine_index, handshaken))

    def on_death_claimed(self, engine_index: int) -> None:
        self.calls.append(("claimed", engine_index, None))


class Plane(EngineDataPlane):
    """A mode that refuses engines named in ``refuse`` and records nothing extra."""

    refuse: set[int]

    async def _start_control(self) -> None:
        return None

    async def _on_handshake_frames(self, sock: Any, frames: list[bytes]) -> None:
        return None

    def _refusal(self, link: EngineLink) -> str | None:
        return "not for this mode" if link.engine_index in self.refuse else None

    def _state_extra(self) -> dict[str, str]:
        return {"handshake_address": "tcp://h:1"}


def plane(count: int = 2) -> tuple[Plane, Listener]:
    listener = Listener()
    out = Plane(
        FleetShape(engine_count=count, start_rank=4),
        listener,
        ProtocolErrorTally(),
        context=cast(Any, object()),  # never used: nothing is opened here
    )
    out.refuse = set()
    return out, listener


def handshaking(out: Plane, index: int) -> EngineLink:
    link = out._links[index]
    link.phase, link.slot = Phase.INIT_SENT, 0
    return link


def registration(index: int, **kwargs: Any) -> list[bytes]:
    return [engine_identity(index), encode_registration(registration_map(index, **kwargs))]


def test_an_engine_is_up_once_both_ready_and_its_registration_came() -> None:
    """READY and the registration travel on different connections, in either order."""
    out, listener = plane()
    link = handshaking(out, 4)
    link.fault_status = FaultStatus("unhealthy", None, 1.0)
    link.ready = True
    out._maybe_up(link)  # registration still missing
    assert out.is_callable(4) is False
    out._on_input_frames(registration(4, vllm_version="0.33.1"))
    assert link.phase is Phase.UP and out.is_callable(4)
    assert link.registration is not None and link.registration.vllm_version == "0.33.1"
    # Pushed after its HELLO (before READY was read): the new process's own, kept.
    assert link.fault_status == FaultStatus("unhealthy", None, 1.0)
    assert listener.calls == [("up", 4, True)]
    out._new_process(link)  # its next process's HELLO: that one starts healthy
    assert link.fault_status is None


def test_an_engine_the_mode_cannot_serve_is_refused_and_counted() -> None:
    out, listener = plane()
    out.refuse = {5}
    link = handshaking(out, 5)
    link.ready = True
    out._on_input_frames(registration(5))
    assert link.phase is Phase.REFUSED and link.refused == "not for this mode"
    assert out._faults.counts == {"engine_refused": 1}
    assert listener.calls == []


@pytest.mark.parametrize(
    ("frames", "kind"),
    [
        ([b"\x04\x00"], "wrong_frame_count"),
        ([b"\x09\x00", b""], "unknown_identity"),
        ([b"\x04\x00", b""], "unexpected_registration"),  # not handshaking
    ],
)
def test_registrations_outside_a_handshake_are_rejected(frames: list[bytes], kind: str) -> None:
    out, _ = plane()
    with pytest.raises(ProtocolError) as raised:
        out._on_input_frames(frames)
    assert raised.value.kind == kind
    assert out._links[4].registration is None


def test_a_second_registration_in_one_handshake_is_rejected() -> None:
    out, _ = plane()
    link = handshaking(out, 4)
    out._on_input_frames(registration(4, vllm_version="first"))
    with pytest.raises(ProtocolError, match="registered outside its handshake"):
        out._on_input_frames(registration(4, vllm_version="second"))
    assert link.registration is not None and link.registration.vllm_version == "first"


def test_an_undecodable_registration_is_counted_and_still_completes_the_handshake() -> None:
    out, _ = plane()
    link = handshaking(out, 4)
    link.ready = True
    out._on_input_frames([engine_identity(4), b"\xc1"])
    assert link.phase is Phase.UP and link.registration is not None
    assert link.registration.vllm_version is None
    assert sum(out._faults.counts.values()) == 1


def test_a_wildcard_kv_events_endpoint_gets_the_host_the_registration_came_from() -> None:
    out, _ = plane()
    handshaking(out, 4)
    kv = publisher_config({"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"}, 0)
    out._on_input_frames(registration(4, kv_events_config=kv), "10.0.0.9")
    reg = out._links[4].registration
    assert reg is not None and reg.kv_events is not None
    assert reg.kv_events.engine_host == "10.0.0.9"
    assert reg.kv_events.target == "10.0.0.9:5557"


def test_confirmed_death_stops_calls_once_and_is_told_once() -> None:
    out, listener = plane()
    link = out._links[4]
    link.phase, link.slot = Phase.UP, 0
    out.confirm_dead(4)
    out.confirm_dead(4)
    assert link.phase is Phase.DEAD
    assert listener.calls == [("down", 4, "dead")]
    with pytest.raises(EngineUnavailable, match="dead"):
        out.send_utility(4, b"payload")  # refused before any socket is touched


def test_the_state_snapshot_names_the_fleet_and_only_engines_worth_restoring() -> None:
    out, _ = plane()
    out.input_address = "tcp://10.0.0.1:7000"
    out._links[4].phase, out._links[4].slot = Phase.UP, 0
    out._links[5].phase = Phase.INIT_SENT  # not ready yet: nothing to restore
    status = FaultStatus("dead", "x", 2.0)
    out.keep_fault_status(4, status)
    address, extra, records = out._state_snapshot()
    assert address == "tcp://10.0.0.1:7000"
    assert extra == {"engine_count": 2, "start_rank": 4, "handshake_address": "tcp://h:1"}
    assert [(r.engine_index, r.fault_status) for r in records] == [(4, status)]
    assert set(out.counters()) == {"vllm_dp_state_file_writes_total"}
