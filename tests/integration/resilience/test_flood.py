"""docs/reliability.md, row A5: a peer flooding an engine's output address neither freezes the
exporter nor grows its memory without bound.

The exporter runs as its own process (``serve``), so its resident memory is measured alone; the
simulated engines and the flooder are processes too. During the flood ``/metrics`` keeps
answering, both engines keep being polled and answering, and the flood is counted. The scenario
is ``bench.flood.run_flood``; the figures for a longer flood are in ``make bench`` (section 6).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.flood import run_flood

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow

FLOOD_S = 6.0
RSS_CAP_MB = 200.0
SCRAPE_BOUND_S = 1.5  # generous on a loaded 2-core CI machine; bench reports real figures


def test_output_flood_is_bounded_and_counted(tmp_path: Path) -> None:
    result = run_flood(FLOOD_S, tmp_path)
    assert result.sent > 10_000, "the flooder did not flood"
    assert result.scrapes, "no scrape completed during the flood"
    assert result.scrape_max < SCRAPE_BOUND_S, f"a scrape took {result.scrape_max:.2f}s"
    assert result.rss_peak_kib / 1024 < RSS_CAP_MB, f"RSS reached {result.rss_peak_kib} KiB"
    assert result.polls > 5, f"only {result.polls} polls during the flood"
    assert result.engines_stayed_up, result.engines_up
    assert result.counted > 1000, f"flood frames counted: {result.counted}"
