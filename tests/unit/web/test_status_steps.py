"""The ``/status`` document built and written in steps (the plugin's ``/dp/status`` on vLLM's
loop) is the document and the text the whole-at-once path gives."""

from __future__ import annotations

import json
from typing import Any

from exporter.base.steps import ENGINES_PER_STEP, run_steps
from exporter.config.settings import ServeConfig
from exporter.metrics.stats import Stats
from exporter.web.statusdoc import json_steps, status_steps
from tests.harness.snapshots import engine_snapshot, polled

CONFIG = ServeConfig(attach="owner", engine_count=2, handshake_address="tcp://127.0.0.1:1")


def counted(steps: Any) -> tuple[Any, int]:
    """The result of ``steps`` and how many times it yielded."""
    count = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, count
        count += 1


def test_the_stepwise_document_is_the_document_and_takes_a_step_per_chunk() -> None:
    snap = polled(*(engine_snapshot(str(i)) for i in range(100)))
    stats = Stats()
    doc, steps = counted(status_steps(snap, CONFIG, stats, now=60.0))
    assert doc == run_steps(status_steps(snap, CONFIG, stats, now=60.0))
    assert [e["engine"] for e in doc["engines"]] == [str(i) for i in range(100)]
    assert steps == 100 // ENGINES_PER_STEP


def test_the_stepwise_text_is_json_dumps_byte_for_byte() -> None:
    snap = polled(*(engine_snapshot(str(i)) for i in range(70)))
    doc = run_steps(status_steps(snap, CONFIG, now=60.0))
    doc["model_name"] = 'm"\\x\n\u00e9'  # escaping and non-ASCII, as json.dumps writes them
    text, steps = counted(json_steps(doc))
    assert text == json.dumps(doc).encode()
    assert steps == 70 // ENGINES_PER_STEP
    assert json.loads(text) == doc


def test_a_document_without_engines_is_written_whole() -> None:
    doc = {"a": 1, "engines": [], "b": {"c": [1, 2]}}
    assert run_steps(json_steps(doc)) == json.dumps(doc).encode()
