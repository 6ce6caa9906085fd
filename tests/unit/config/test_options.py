"""Every flag names a setting, and booleans read as operators write them."""

from __future__ import annotations

from dataclasses import fields

import pytest

from exporter.config.options import OPTIONS, parse_switch
from exporter.config.settings import ServeConfig


def test_every_option_but_the_config_file_is_a_setting() -> None:
    names = {f.name for f in fields(ServeConfig)}
    assert {name for name, _, _ in OPTIONS} - names == {"config"}
    assert {"max_watchers", "load_publisher"} <= {name for name, _, _ in OPTIONS}


@pytest.mark.parametrize(("text", "value"), [("on", True), (" YES ", True), ("0", False)])
def test_switches(text: str, value: bool) -> None:
    assert parse_switch(text) is value


def test_anything_else_is_no_switch() -> None:
    with pytest.raises(ValueError, match="not a boolean"):
        parse_switch("maybe")
