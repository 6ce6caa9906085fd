"""The conformance suite's one fixture: ``fleet_kind``, a started ``FleetClient`` of every kind
over three engines, with its fault hooks (``tests/harness/fleet_kinds.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness.fleet_kinds import KINDS, FleetKind, start_kind


@pytest.fixture(params=KINDS)
async def fleet_kind(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[FleetKind]:
    """``fake``, ``owner``, ``relay``, ``http``, ``http_plugin`` or ``inprocess``: started, every
    engine connected and answering; stopped (client, then engines and servers) at the end."""
    kind = await start_kind(request.param, tmp_path, monkeypatch)
    yield kind
    await kind.stop()
