"""What the vLLM 0.34 engine-code scenarios share (``test_vllm034.py``,
``test_vllm034_inprocess.py``; docs/e2e.md, scenario 15): the stub "model"'s text, the
checkpoint states (an admin action's answer is read with ``exporter_proc.confirmed``)."""

from __future__ import annotations

ENGINES = ("0", "1")
POLLED = ("is_sleeping", "is_scheduler_paused", "get_weight_version", "checkpoint_state")
RUNNING = ["running", None]
PREPARED = ["prepared", None]
PROMPT = "w1 w2 w3 w4"
#: The tiny model's words (``e2e/tiny_model.py``), which the stub's tokens cycle through.
WORDS = 500


def counted(words: int, start: int) -> str:
    """The stub model's text for ``words`` tokens after a sequence of ``start`` tokens
    (``w<n mod 500>``: the tokenizer has 500 words)."""
    return "".join(f" w{n % WORDS}" for n in range(start, start + words))
