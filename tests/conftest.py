"""Suite-wide fixtures; they only wire the helpers of ``tests/harness/``."""

from __future__ import annotations

import pytest

from tests.harness.wire import load_vectors


@pytest.fixture
def vectors() -> dict[str, bytes]:
    """Vector name → bytes of ``tests/data/engine-core.json``."""
    return dict(load_vectors())
