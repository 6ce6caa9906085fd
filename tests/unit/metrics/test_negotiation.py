"""``exporter/metrics/negotiation.py``: which of two formats, and gzip or not, an ``Accept`` and
an ``Accept-Encoding`` header ask for (pure). The scrapers' own headers, q-value ordering and
the service's answers are in tests/integration/resilience/test_http_negotiation.py."""

from __future__ import annotations

import pytest

from exporter.metrics.negotiation import OPENMETRICS, TEXT, metrics_format, wants_gzip


@pytest.mark.parametrize(
    ("accept", "fmt"),
    [
        # The most specific range decides a format's weight, wherever it stands.
        ("text/plain;q=0, */*", OPENMETRICS),
        ("*/*, text/plain;q=0", OPENMETRICS),
        ("text/*;q=0.2, text/plain;q=0.9, application/openmetrics-text;q=0.5", TEXT),
        ("application/*;q=0.1, application/openmetrics-text;q=0.8, text/plain;q=0.5", OPENMETRICS),
        # Versions 1, 1.x and 1.x.y of OpenMetrics; nothing else.
        ("application/openmetrics-text;version=1", OPENMETRICS),
        ("application/openmetrics-text;version=1.1", OPENMETRICS),
        ('application/openmetrics-text;version="1.0.0"', OPENMETRICS),
        ("application/openmetrics-text;version=1.0.0.0", TEXT),
        ("application/openmetrics-text;version=", TEXT),
        # Case and spaces do not matter; a q-value that is no number drops the range.
        ("APPLICATION/OpenMetrics-Text ; Q=0.9", OPENMETRICS),
        ("application/openmetrics-text;q=high", TEXT),
        ("application/openmetrics-text;q=1.5", TEXT),
        ("text/plain;q=0, application/openmetrics-text;q=0", TEXT),  # nothing fits: text
    ],
)
def test_the_format_an_accept_header_asks_for(accept: str, fmt: str) -> None:
    assert metrics_format(accept) == fmt


def test_only_the_first_64_ranges_are_read() -> None:
    filler = ", ".join(f"x/y{i}" for i in range(63))
    assert metrics_format(f"{filler}, application/openmetrics-text") == OPENMETRICS
    assert metrics_format(f"{filler}, x/y63, application/openmetrics-text") == TEXT


@pytest.mark.parametrize(
    ("accept_encoding", "gzipped"),
    [
        ("identity;q=0.5, gzip;q=0.5", True),  # a tie is not below identity
        ("*;q=0.5, gzip;q=0", False),  # gzip's own q-value beats the wildcard's
        ("gzip;q=0, *;q=1", False),
        ("x-gzip;q=0.4, identity;q=0.3", True),
        ("gzip;q=0.1, gzip;q=0", True),  # the first mention counts
        ("identity", False),
    ],
)
def test_gzip_is_served_when_its_weight_is_above_zero_and_not_below_identity(
    accept_encoding: str, gzipped: bool
) -> None:
    assert wants_gzip(accept_encoding) is gzipped
