"""The simulated engine's state machine imports no I/O: checked in a fresh interpreter (a
subprocess), since this test process has long imported asyncio, zmq and aiohttp."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Every test here starts a subprocess (see the `slow` marker in pyproject.toml).
pytestmark = pytest.mark.slow


def test_state_module_is_pure() -> None:
    """Importing the state machine pulls in no sockets, no event loop, no HTTP."""
    code = (
        "import sys, exporter.sim.state; "
        "print(sorted(m for m in ('asyncio', 'zmq', 'aiohttp', 'socket') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert out.stdout.strip() == "[]"
