"""``exporter/protocol/strings.py``: the one rule for strings engines send (pure). Cutting at
the cap, the digest that keeps long strings apart, surrogates, bytes and nested results are in
tests/unit/protocol/test_engine_strings.py; here: other caps, what the marker check reads,
and values the rule leaves alone."""

from __future__ import annotations

import pytest

from exporter.protocol.strings import (
    CUT_MARKER,
    MAX_ENGINE_STRING,
    ascii_digits,
    bound_bytes,
    bound_text,
    bound_value,
    is_cut,
)


def test_a_smaller_cap_cuts_by_the_same_rule() -> None:
    text = "ü" * 100  # 200 bytes
    assert bound_text(text, 200) == text
    cut = bound_text(text, 32)
    assert is_cut(cut) and len(cut.encode()) <= 32
    # 11 bytes are left beside the marker: five characters, never half of the sixth.
    assert cut.index(CUT_MARKER) == 5 and cut.startswith("ü" * 5)
    assert bound_text(text, 32) != bound_text("ü" * 99 + "u", 32)


def test_only_a_marker_at_the_very_end_means_cut() -> None:
    marker = f"{CUT_MARKER}0123456789ab]"
    assert is_cut("v" + marker)
    assert not is_cut(marker + " and more")
    assert not is_cut(f"v{CUT_MARKER}0123456789AB]")  # the digest is lower-case hex
    assert not is_cut(f"v{CUT_MARKER}0123]")


def test_a_string_and_its_bytes_are_cut_alike() -> None:
    text = "w" * 1000
    assert bound_bytes(text.encode()) == bound_text(text).encode()
    assert len(bound_bytes(b"\x00" * (MAX_ENGINE_STRING + 1))) == MAX_ENGINE_STRING


def test_values_that_are_not_text_are_kept_as_they_are() -> None:
    big = 10**40
    marker = object()
    value = {"n": big, "f": 1.5, "b": False, "none": None, "other": marker}
    bounded = bound_value(value)
    assert bounded == value and bounded["other"] is marker
    assert bound_value((1, "x")) == (1, "x") and isinstance(bound_value((1,)), tuple)


@pytest.mark.parametrize(
    ("text", "digits"),
    [
        ("0", True),
        ("65535", True),
        ("", False),
        ("²", False),
        ("\u0661", False),
        ("1\u0661", False),
    ],
)
def test_ranks_and_ports_are_ascii_digits_only(text: str, digits: bool) -> None:
    assert ascii_digits(text) is digits
