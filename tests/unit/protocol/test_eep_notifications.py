"""Elastic-EP notifications (``EEP_NOTIFICATION_CALL_ID``) are the sender's: recorded on the
engine whose connection carried them, with the DP rank they name kept as reported (pure).

vLLM's engine sends ``[event, parallel_config.data_parallel_rank]``: 0 on every dense DP engine
(``reconfigure_for_independent_dp_rank``), a MoE engine's new rank once a reconfiguration
renumbered it; never its engine index as such (docs/protocol.md C.6)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.pushes import PushBook
from exporter.error import ProtocolError
from exporter.protocol.pushes import EEP_NOTIFICATION_CALL_ID, decode_eep_notification

EEP = EEP_NOTIFICATION_CALL_ID
#: sender position → its engine index in a fleet of three.
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def book() -> tuple[PushBook, ProtocolErrorTally]:
    faults = ProtocolErrorTally()
    return PushBook(faults, clock=lambda: 50.0), faults


@pytest.mark.parametrize("event", ["RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE"])
@pytest.mark.parametrize("rank", [0, 1, 2, 65535])
def test_any_rank_vllm_can_name_is_read_as_reported(event: str, rank: int) -> None:
    assert decode_eep_notification([event, rank]) == (event, rank)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "RECONFIGURE_FINISHED",
        ["RECONFIGURE_FINISHED"],
        ["RECONFIGURE_FINISHED", 0, 1],
        ["RECONFIGURE_FINISHED", "0"],
        ["RECONFIGURE_FINISHED", False],
        ["RECONFIGURE_FINISHED", 1.0],
        ["RECONFIGURE_FINISHED", -1],  # vLLM's KEEP_CURRENT_RANK: never a config's rank
        ["RECONFIGURE_FINISHED", 65536],
        ["NEW_EVENT", 0],
        [0, 0],
    ],
)
def test_a_notification_of_another_shape_is_refused(value: Any) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_eep_notification(value)
    assert err.value.kind == "bad_push"


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
@pytest.mark.parametrize("event", ["RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE"])
def test_a_dense_engines_rank_0_is_recorded_on_the_sender_only(position: int, event: str) -> None:
    pushes, faults = book()
    me = str(position)
    assert pushes.on_push(me, position, EEP, [event, 0])
    assert set(pushes.membership) == {me}  # never engine 0's record, unless engine 0 sent it
    recorded = pushes.membership[me]
    assert (recorded.event, recorded.engine, recorded.received_unix) == (event, me, 50.0)
    assert (recorded.dp_rank, recorded.reported_rank) == (position, 0)
    assert faults.counts == {}
    assert pushes.counts_of(me) == {"elastic_ep": 1}


def test_a_renumbered_moe_engines_new_rank_is_shown_on_its_own_record() -> None:
    """Engine 3 of a MoE fleet renumbered to DP rank 1 by a scale-down (vLLM's
    ``reinitialize_distributed`` with ``new_data_parallel_rank`` 1): engine 1's own record,
    made before, is left as it was."""
    pushes, faults = book()
    pushes.on_push("1", 1, EEP, ["SHUTDOWN_COMPLETE", 1])
    before = pushes.membership["1"]
    assert pushes.on_push("3", 3, EEP, ["RECONFIGURE_FINISHED", 1])
    assert pushes.membership["1"] == before
    mine = pushes.membership["3"]
    assert (mine.event, mine.dp_rank, mine.reported_rank) == ("RECONFIGURE_FINISHED", 3, 1)
    assert faults.counts == {}


def test_a_bad_notification_changes_no_record_and_is_counted() -> None:
    pushes, faults = book()
    pushes.on_push("2", 2, EEP, ["SHUTDOWN_COMPLETE", 0])
    kept = pushes.membership["2"]
    assert not pushes.on_push("2", 2, EEP, ["SHUTDOWN_COMPLETE", "0"])
    assert not pushes.on_push("2", 2, EEP, ["UNHEARD_OF", 0])
    assert pushes.membership == {"2": kept}
    assert faults.counts == {"bad_push": 2}
    assert pushes.counts_of("2") == {"elastic_ep": 3}  # every push is counted
