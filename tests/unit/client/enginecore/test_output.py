"""``OutputReader``: every output message and connection event is attributed to one engine, and
only the engine's own connection is believed when it says ENGINE_CORE_DEAD (driven by hand, no
sockets: the monitor's mapping is filled in as the monitor would)."""

from __future__ import annotations

import pytest
import zmq

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.links import MAX_FRAME_BYTES, FleetShape, Phase
from exporter.client.enginecore.output import OutputReader
from exporter.error import ProtocolError
from exporter.protocol import ENGINE_CORE_DEAD, EngineOutput, encode_utility_reply


class Listener:
    """Records every callback; ``answers`` is what ``on_output`` returns."""

    def __init__(self, answers: bool = True) -> None:
        self.answers = answers
        self.calls: list[tuple[str, int, object]] = []

    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        self.calls.append(("output", engine_index, output.utility))
        return self.answers

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        self.calls.append(("down", engine_index, reason))

    def on_engine_hello(self, engine_index: int) -> None:
        return None

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        self.calls.append(("up", engine_index, handshaken))

    def on_death_claimed(self, engine_index: int) -> None:
        self.calls.append(("claimed", engine_index, None))


class Reader(OutputReader):
    def __init__(self, listener: Listener) -> None:
        super().__init__(FleetShape(engine_count=2), listener, ProtocolErrorTally())
        self.confirmed: list[int] = []

    def confirm_dead(self, engine_index: int) -> None:
        self.confirmed.append(engine_index)


def reader(phase: Phase = Phase.UP, answers: bool = True) -> tuple[Reader, Listener]:
    listener = Listener(answers)
    out = Reader(listener)
    for link in out._links.values():
        link.slot, link.phase = 0, phase
    return out, listener


def phases(out: Reader) -> list[Phase]:
    return [link.phase for link in out._links.values()]


def test_a_reply_goes_to_the_listener_and_marks_its_connection_the_engines_own() -> None:
    out, listener = reader()
    link = out._links[1]
    out._on_output_frames(link, [encode_utility_reply(1, 7, value=True)], fd=12)
    assert listener.calls[0][:2] == ("output", 1)
    assert link.engine_fd == 12


def test_an_output_that_answered_nothing_proves_no_connection() -> None:
    out, _ = reader(answers=False)
    link = out._links[0]
    out._on_output_frames(link, [encode_utility_reply(0, 7)], fd=12)
    assert link.engine_fd is None


def test_an_output_carrying_another_engines_index_is_rejected() -> None:
    """The address it came in on decides the engine: a peer cannot speak for another."""
    out, listener = reader()
    with pytest.raises(ProtocolError) as raised:
        out._on_output_frames(out._links[0], [encode_utility_reply(1, 7)], fd=12)
    assert raised.value.kind == "wrong_engine_index"
    assert listener.calls == []


def test_oversized_and_extra_frames_are_counted() -> None:
    out, listener = reader()
    with pytest.raises(ProtocolError) as raised:
        out._on_output_frames(out._links[0], [b"\x00" * (MAX_FRAME_BYTES + 1)], fd=3)
    assert raised.value.kind == "oversized_frame"
    out._on_output_frames(out._links[0], [encode_utility_reply(0, 1), b"x"], fd=3)
    assert out._faults.counts == {"extra_frames": 1}
    assert len(listener.calls) == 1  # the first frame is still read


def test_a_restored_engine_that_answers_is_up_again_without_a_handshake() -> None:
    out, listener = reader(Phase.RESTORED)
    out._on_output_frames(out._links[0], [encode_utility_reply(0, 1)], fd=4)
    assert out._links[0].phase is Phase.UP
    assert listener.calls[0] == ("up", 0, False)


def test_engine_core_dead_is_believed_only_from_the_engines_own_connection() -> None:
    out, listener = reader()
    link = out._links[0]
    link.live_peers, link.engine_fd = {4, 5}, 4
    out._on_output_frames(link, [ENGINE_CORE_DEAD], fd=5)  # a stranger's claim
    assert out.confirmed == [] and listener.calls == [("claimed", 0, None)]
    out._on_output_frames(link, [ENGINE_CORE_DEAD], fd=4)
    assert out.confirmed == [0]
    link.phase = Phase.DEAD
    out._on_output_frames(link, [ENGINE_CORE_DEAD], fd=4)  # already dead: nothing more
    assert out.confirmed == [0]


def test_a_message_is_attributed_by_connection_even_after_it_closed() -> None:
    out, _ = reader()
    link = out._links[1]
    out._by_fd[7] = link
    assert out._sender(7) is link
    out._closed_by_fd[8] = out._links[0]
    assert out._sender(8) is out._links[0]
    with pytest.raises(ProtocolError, match="unknown connection 9"):
        out._sender(9)


def test_the_engines_connection_closing_makes_it_lost_and_a_new_one_restores_it() -> None:
    """A SIGKILLed engine sends nothing: the monitor's close is what fails its calls."""
    out, listener = reader()
    link = out._links[0]
    out._on_connection_event(link, zmq.EVENT_ACCEPTED, 4)
    out._on_connection_event(link, zmq.EVENT_ACCEPTED, 5)
    out._on_connection_event(link, zmq.EVENT_DISCONNECTED, 5)  # a stranger left
    assert phases(out) == [Phase.UP, Phase.UP] and link.live_peers == {4}
    out._on_connection_event(link, zmq.EVENT_DISCONNECTED, 4)
    assert phases(out) == [Phase.LOST, Phase.UP]
    assert listener.calls == [("down", 0, "disconnected")]
    out._on_connection_event(link, zmq.EVENT_ACCEPTED, 6)
    assert phases(out) == [Phase.RESTORED, Phase.UP] and link.live_peers == {6}
