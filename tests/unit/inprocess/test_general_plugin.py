"""vLLM's general plugin hook (``exporter.inprocess.general_plugin``): vLLM calls it in every
one of its processes, so it must speak only in the main process, only when the Rust front end
(which loads no endpoint plugin) is on, read the variable as vLLM does, and never raise."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping

import pytest

from exporter.inprocess.general_plugin import (
    LOGGER,
    NOTICE,
    rust_front_end_notice,
    rust_front_end_on,
)

RUST = {"VLLM_USE_RUST_FRONTEND": "1"}


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("2", True),
        ("-1", True),
        (" 1 ", True),
        ("0", False),
        ("", False),
        ("yes", False),
    ],
)
def test_the_variable_is_read_as_vllm_reads_it(value: str, on: bool) -> None:
    """An integer, on when not zero; anything else (vLLM would fail on it) reads as off."""
    assert rust_front_end_on({"VLLM_USE_RUST_FRONTEND": value}) is on


def test_unset_is_off() -> None:
    assert rust_front_end_on({}) is False


def test_the_notice_is_logged_once_in_vllms_main_process(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rust_front_end_notice(RUST, "MainProcess") is True
    assert [(r.name, r.getMessage()) for r in caplog.records] == [(LOGGER, NOTICE)]
    assert "relay mode" in NOTICE and "HTTP mode" in NOTICE  # it says what to do instead


@pytest.mark.parametrize(
    ("environ", "process"),
    [
        (RUST, "EngineCore_DP0"),  # an engine core: vLLM's child process
        (RUST, "VllmWorker-0"),
        ({"VLLM_USE_RUST_FRONTEND": "0"}, "MainProcess"),
        ({}, "MainProcess"),
    ],
)
def test_silent_in_child_processes_and_without_the_rust_front_end(
    caplog: pytest.LogCaptureFixture, environ: Mapping[str, str], process: str
) -> None:
    with caplog.at_level(logging.DEBUG):
        assert rust_front_end_notice(environ, process) is False
    assert not caplog.records


class Exploding(Mapping[str, str]):
    """An environment that cannot be read: the hook must not stop vLLM over it."""

    def __getitem__(self, key: str) -> str:
        raise RuntimeError("no environment")

    def __iter__(self) -> Iterator[str]:
        raise RuntimeError("no environment")

    def __len__(self) -> int:
        return 1

    def get(self, key: str, default: object = None) -> str:
        raise RuntimeError("no environment")


def test_the_hook_never_raises() -> None:
    assert rust_front_end_notice(Exploding(), "MainProcess") is False


def test_the_module_imports_nothing_of_the_exporters() -> None:
    """It runs in every vLLM process: importing the exporter there would cost every worker."""
    import ast
    from pathlib import Path

    import exporter.inprocess.general_plugin as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert not {n for n in imported if n.split(".")[0] == "exporter"}
