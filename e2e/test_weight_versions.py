"""Issue 14, scenario 7: weight versions on real engines (waits for issue 15's export)."""

from __future__ import annotations

import pytest


@pytest.mark.skip(reason="needs weight-version export (issue 15)")
def test_scenario7_weight_versions_inconsistent_then_consistent() -> None:
    """To write once the exporter exports weight versions (RL invariants, issue 15): set
    different versions on the two real engines (vLLM's RL routes, ``VLLM_SERVER_DEV_MODE=1``)
    and see the inconsistency counted; set them equal and see the fleet consistent."""
