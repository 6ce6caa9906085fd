"""The typed error family (``exporter.error``): callers catch ``ExporterError`` to tell the
exporter's own refusals from bugs, and read ``kind`` and the consensus values off the errors
that carry them, so the hierarchy and the messages are part of the contract."""

from __future__ import annotations

import pytest

from exporter.error import (
    ConfigError,
    EngineUnavailable,
    ExporterError,
    HandshakeError,
    InconsistentUtilityResults,
    MethodNotAllowed,
    ProtocolError,
    StartupError,
)


@pytest.mark.parametrize(
    "cls",
    [
        ConfigError,
        ProtocolError,
        HandshakeError,
        EngineUnavailable,
        MethodNotAllowed,
        InconsistentUtilityResults,
        StartupError,
    ],
)
def test_every_error_is_an_exporter_error_and_not_a_builtin_one(cls: type[Exception]) -> None:
    """One ``except ExporterError`` catches them all; none is caught as a ``ValueError``."""
    assert issubclass(cls, ExporterError)
    assert issubclass(ExporterError, Exception)
    assert not issubclass(cls, (ValueError, OSError, KeyError))


def test_a_protocol_error_keeps_its_kind_and_prefixes_the_message() -> None:
    exc = ProtocolError("not_msgpack", "frame 2 is not msgpack")
    assert exc.kind == "not_msgpack"
    assert str(exc) == "not_msgpack: frame 2 is not msgpack"
    # The kind is recoverable from the text, as callers that strip it expect.
    assert str(exc).removeprefix(f"{exc.kind}: ") == "frame 2 is not msgpack"


def test_inconsistent_results_name_each_engine_with_its_value() -> None:
    exc = InconsistentUtilityResults("is_sleeping", [True, False], engines=["0", "1"])
    assert exc.method == "is_sleeping"
    assert exc.values == [True, False]
    assert exc.engines == ["0", "1"]
    assert (
        str(exc)
        == "engines returned different is_sleeping results: engine 0: True, engine 1: False"
    )


def test_inconsistent_results_without_engines_list_the_values() -> None:
    exc = InconsistentUtilityResults("weight_version", ("v1", "v2"))
    assert exc.engines is None
    assert exc.values == ["v1", "v2"]  # copied into a list, whatever sequence came in
    assert str(exc) == "engines returned different weight_version results: ['v1', 'v2']"


def test_no_result_at_all_is_said_as_such() -> None:
    """vLLM's Rust client raises the same error when no engine produced a result."""
    exc = InconsistentUtilityResults("is_sleeping", [], engines=["0"])
    assert exc.values == []
    assert str(exc) == "no engine returned a is_sleeping result"


def test_the_values_are_a_copy_not_the_callers_list() -> None:
    values: list[object] = [1, 2]
    exc = InconsistentUtilityResults("m", values)
    values.append(3)
    assert exc.values == [1, 2]
