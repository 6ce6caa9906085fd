"""The system tier: every test under ``tests/system/`` is marked ``slow``.

These tests exercise what ships and what runs beside it: deploy files against Kubernetes schemas,
promtool and a real Prometheus, the status page in headless Chromium, 1,024 engines, and the
benchmarks' smoke runs. ``pytest -m "not slow"`` leaves them out.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items, not only this directory's.
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.slow)
