"""``exporter/fleetstate/history.py``: the last hour as a bounded ring of buckets (pure). The
ring's bound, the worst state of a bucket and the window are in
tests/unit/web/test_statuspage.py; here: how polls fold and when a new bucket starts."""

from __future__ import annotations

from exporter.fleetstate.history import FleetHistory, worst


def test_the_worse_state_wins_and_a_state_it_does_not_know_counts_as_unknown() -> None:
    assert worst("consistent", "inconsistent") == "inconsistent"
    assert worst("unknown", "consistent") == "unknown"
    assert worst("inconsistent", "unknown") == "inconsistent"
    assert worst("consistent", "unsupported") == "unsupported"  # as bad as unknown
    assert worst("inconsistent", "unsupported") == "inconsistent"


def test_a_bucket_keeps_the_fewest_engines_up_and_the_most_expected() -> None:
    history = FleetHistory(bucket_s=30.0)
    history.record(60.0, {"is_sleeping": "consistent"}, 4, 4)
    history.record(70.0, {"is_sleeping": "consistent", "get_weight_version": "unknown"}, 2, 5)
    history.record(89.9, {"is_sleeping": "consistent"}, 5, 5)
    (entry,) = history
    assert (entry.bucket, entry.start_unix, entry.end_unix, entry.polls) == (2, 60.0, 89.9, 3)
    assert (entry.engines_up_min, entry.engines_expected) == (2, 5)
    # A method first seen in a later poll of the bucket is kept from then on.
    assert entry.states == {"is_sleeping": "consistent", "get_weight_version": "unknown"}


def test_a_poll_in_the_next_bucket_starts_a_new_entry_whatever_the_gap() -> None:
    history = FleetHistory(bucket_s=30.0)
    history.record(29.9, {"is_sleeping": "inconsistent"}, 1, 2)
    history.record(30.0, {"is_sleeping": "consistent"}, 2, 2)
    history.record(900.0, {"is_sleeping": "consistent"}, 2, 2)
    assert [e.bucket for e in history.entries()] == [0, 1, 30]
    assert [e.states["is_sleeping"] for e in history] == [
        "inconsistent",
        "consistent",
        "consistent",
    ]
    assert len(history.entries(now=900.0 + 3600.0 - 30.0)) == 1  # the others ended too long ago


def test_a_window_narrower_than_a_bucket_keeps_one_bucket() -> None:
    history = FleetHistory(bucket_s=30.0, window_s=10.0)
    assert history.capacity == 1
    history.record(0.0, {}, 1, 1)
    history.record(31.0, {}, 1, 1)
    assert [e.bucket for e in history] == [1]
