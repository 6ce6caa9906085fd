"""``exporter/inprocess/shared.py``'s one read of another API server's share file: a regular
file, bounded, checked on the opened descriptor (no wait on a FIFO swapped in after the
directory was listed, no link followed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from exporter.inprocess.shared import read_regular


def test_a_regular_file_is_read_up_to_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "vllm_dp_exporter.1.json"
    path.write_bytes(b"x" * 100)
    assert read_regular(str(path), 40) == b"x" * 40
    assert read_regular(str(path), 1000) == b"x" * 100


def test_a_fifo_or_a_link_is_refused_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)  # no writer: a blocking open would wait forever
    with pytest.raises(OSError, match="not a regular file"):
        read_regular(str(fifo), 10)
    target = tmp_path / "real.json"
    target.write_bytes(b"{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    with pytest.raises(OSError):
        read_regular(str(link), 10)
