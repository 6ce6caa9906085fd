"""The status page's section of ``make bench`` (bench/statuspage.py), at a tiny size."""

from __future__ import annotations

from bench.statuspage import insert_section, measure, section


def test_statuspage_section_measures_and_lands_before_the_results() -> None:
    result = measure(8, iterations=2)
    assert result.engines == 8 and result.status_ms > 0 and result.page_ms > 0
    assert result.status_bytes > 1000 and result.page_bytes > 1000
    lines = section([result], 2)
    assert lines[0].startswith("## Status page") and any(line.startswith("| 8 |") for line in lines)
    report = insert_section("# Benchmarks\n\ntext\n\n<!-- bench-results: {} -->\n", lines)
    assert report.index("## Status page") < report.index("<!-- bench-results:")
