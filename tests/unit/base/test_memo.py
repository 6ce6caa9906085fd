"""``ShortMemo``: one read serves the reads of the same moment, never longer, never after a
``clear`` (in-process mode clears it after every fan-out, so a gate's verdict reads afresh)."""

from __future__ import annotations

from exporter.base.memo import ShortMemo


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_read_serves_the_same_ranks_within_the_window_only() -> None:
    clock, reads = Clock(), []
    memo = ShortMemo(0.01, clock)

    def read() -> int:
        reads.append(clock.now)
        return len(reads)

    assert memo.get("counts", (0, 1), read) == 1
    clock.now += 0.009
    assert memo.get("counts", (0, 1), read) == 1  # the same moment: not read again
    assert memo.get("counts", (0, 2), read) == 2  # other ranks: read
    assert memo.get("own", (0, 2), read) == 3  # another key: its own read
    clock.now += 0.01
    assert memo.get("counts", (0, 2), read) == 4  # past the window: read again
    memo.clear()
    assert memo.get("counts", (0, 2), read) == 5  # cleared: read again at once
    assert len(reads) == 5
