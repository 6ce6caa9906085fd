"""``LateReplies``: a reply to a call given up on is late once, only from the engine asked, and
the memory of calls given up on is bounded."""

from __future__ import annotations

from exporter.client.enginecore.late import MAX_GIVEN_UP, LateReplies


def test_a_given_up_call_is_claimed_once_and_only_by_its_engine() -> None:
    late = LateReplies()
    late.give_up(7, engine_index=1)
    assert not late.claim(7, 2, "2")  # another engine: not ours to claim
    assert late.claim(7, 1, "1")
    assert not late.claim(7, 1, "1")  # a second reply to the same call
    assert not late.claim(8, 1, "1")  # never given up on
    assert late.counts == {"1": 1}


def test_the_oldest_calls_are_forgotten_past_the_limit() -> None:
    late = LateReplies(limit=2)
    for call_id in (1, 2, 3):
        late.give_up(call_id, 0)
    assert [late.claim(c, 0, "0") for c in (1, 2, 3)] == [False, True, True]
    assert MAX_GIVEN_UP == 4096 and late.counts == {"0": 2}
