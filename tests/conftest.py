"""Shared helpers: free loopback ports and the wire vectors (copied from the shared spec)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def load_vectors() -> dict[str, bytes]:
    raw = json.loads((DATA / "engine-core.json").read_text())["vectors"]
    return {name: bytes.fromhex(v["hex"]) for name, v in raw.items()}


@pytest.fixture
def vectors() -> dict[str, bytes]:
    return load_vectors()


@pytest.fixture
def handshake_address() -> str:
    return loopback_address()
