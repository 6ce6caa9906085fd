"""The byte-exact wire vectors (``tests/data/engine-core.json``) and loopback addresses."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from exporter.base.ports import free_listen_port

DATA = Path(__file__).resolve().parents[1] / "data"


@functools.cache
def load_vectors() -> dict[str, bytes]:
    """Vector name → bytes."""
    raw = json.loads((DATA / "engine-core.json").read_text())["vectors"]
    return {name: bytes.fromhex(v["hex"]) for name, v in raw.items()}


def vector(name: str) -> bytes:
    return load_vectors()[name]


def loopback_address() -> str:
    """A handshake address: engines may dial it before the exporter binds it."""
    return f"tcp://127.0.0.1:{free_listen_port()}"
