"""An engine's ``checkpoint_state`` reply as vLLM 0.34 sends it, and every other shape (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.protocol.checkpoint import (
    CHECKPOINT_STATES,
    checkpoint_state_of,
    is_checkpoint,
    read_checkpoint,
)


@pytest.mark.parametrize("state", CHECKPOINT_STATES)
def test_every_state_of_vllm_reads_with_or_without_an_error(state: str) -> None:
    assert read_checkpoint([state, None]) == (state, None)
    assert read_checkpoint((state, "CUDA error")) == (state, "CUDA error")
    assert checkpoint_state_of([state, "x"]) == state


@pytest.mark.parametrize(
    "value",
    [
        None,
        "running",
        ["running"],
        ["running", None, None],
        ["RUNNING", None],  # vLLM's StrEnum values are lower case
        ["snapshotting", None],  # a state this release does not name: fail closed
        [1, None],
        ["running", 7],
        ["running", ["nested"]],
        {"state": "running"},
        [True, False],
    ],
)
def test_anything_else_is_no_checkpoint_state(value: Any) -> None:
    assert read_checkpoint(value) is None and not is_checkpoint(value)
    assert checkpoint_state_of(value) is None
