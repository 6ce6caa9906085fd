"""Fixtures of the demo's unit tests."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def no_exporter_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``VLLM_DP_EXPORTER_*`` variable of the shell running the tests leaks into a demo's
    resolved configuration."""
    for name in [n for n in os.environ if n.startswith("VLLM_DP_EXPORTER_")]:
        monkeypatch.delenv(name)
