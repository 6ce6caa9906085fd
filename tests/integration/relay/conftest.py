"""Fixtures of the relay-mode tests (the harness: ``tests/harness/relay.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness.relay import MakeHarness, RelayHarnesses


@pytest.fixture
async def make_harness(tmp_path: Path) -> AsyncIterator[MakeHarness]:
    harnesses = RelayHarnesses(tmp_path)
    yield harnesses.make
    await harnesses.close()
