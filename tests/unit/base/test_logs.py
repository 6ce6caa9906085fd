"""Inside vLLM's API server nothing handles the root logger: the plugin's logging goes to a
handler on the ``exporter`` logger alone, the audit included, and leaves the host's untouched."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from exporter.base.logs import configure_embedded_logging, log_audit


@pytest.fixture
def exporter_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("exporter")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    yield logger
    logger.handlers[:], logger.propagate = saved[0], saved[1]
    logger.setLevel(saved[2])


def test_warnings_and_the_audit_reach_the_stream_and_the_root_is_untouched(
    exporter_logger: logging.Logger,
) -> None:
    root_handlers = logging.getLogger().handlers[:]
    stream = io.StringIO()
    configure_embedded_logging("warning", "json", stream=stream)
    logging.getLogger("exporter.inprocess").info("not at warning level")
    logging.getLogger("exporter.inprocess").warning("a warning")
    log_audit({"time": "t", "event": "admin_request", "action": "sleep", "status": 200})
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["message"] for r in records] == ["a warning", "admin request sleep 200"]
    assert records[1]["action"] == "sleep"
    assert logging.getLogger().handlers == root_handlers
    assert exporter_logger.propagate is False


def test_a_second_call_replaces_its_own_handler(exporter_logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_embedded_logging("info", "text", stream=first)
    configure_embedded_logging("info", "text", stream=second)
    logging.getLogger("exporter.x").warning("once")
    assert first.getvalue() == "" and second.getvalue().count("once") == 1
