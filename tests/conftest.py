"""Shared helpers: free loopback ports and the wire vectors (copied from the shared spec)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.ports import free_listen_port

__all__ = ["free_listen_port", "loopback_address"]

DATA = Path(__file__).parent / "data"


def loopback_address() -> str:
    """A handshake address: engines may dial it before the exporter binds it."""
    return f"tcp://127.0.0.1:{free_listen_port()}"


def load_vectors() -> dict[str, bytes]:
    raw = json.loads((DATA / "engine-core.json").read_text())["vectors"]
    return {name: bytes.fromhex(v["hex"]) for name, v in raw.items()}


@pytest.fixture
def vectors() -> dict[str, bytes]:
    return load_vectors()


@pytest.fixture
def handshake_address() -> str:
    return loopback_address()
