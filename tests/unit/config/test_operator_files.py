"""Operator files (config, token, targets, basic-auth) are read with a bound: a wrong path to
an endless or huge file is one clear error, never a start that reads for ever."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.config.rules import MAX_TEXT_FILE_BYTES, read_text_file, read_token_file
from exporter.error import ConfigError
from exporter.remote.credentials import BasicAuth


def test_an_endless_device_is_one_error() -> None:
    """E11: a character device (an endless one here) is not a regular file: refused unread."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero")
    with pytest.raises(ConfigError, match="not a regular file"):
        read_text_file("/dev/zero", "config file")


def test_a_file_over_the_bound_is_refused_and_one_at_it_is_read(tmp_path: Path) -> None:
    at = tmp_path / "at"
    at.write_bytes(b"a" * MAX_TEXT_FILE_BYTES)
    assert len(read_text_file(str(at), "config file")) == MAX_TEXT_FILE_BYTES
    over = tmp_path / "over"
    over.write_bytes(b"a" * (MAX_TEXT_FILE_BYTES + 1))
    for read in (
        lambda: read_text_file(str(over), "config file"),
        lambda: read_token_file(str(over), "--admin-token-file"),
        lambda: BasicAuth.from_file(str(over)),
    ):
        with pytest.raises(ConfigError, match="larger than"):
            read()


def test_not_utf8_and_missing_files_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_bytes(b"tok\xff\xfe")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_token_file(str(bad), "--admin-token-file")
    with pytest.raises(ConfigError, match=str(tmp_path / "missing")):
        read_text_file(str(tmp_path / "missing"), "config file")
