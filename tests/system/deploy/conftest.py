"""Fixtures of the deployment-artefact tests (the helpers: ``tests/harness/artefacts.py``)."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.harness import artefacts


@pytest.fixture(scope="session")
def deploy() -> ModuleType:
    """The ``tests.harness.artefacts`` module (tests may also import it directly)."""
    return artefacts
