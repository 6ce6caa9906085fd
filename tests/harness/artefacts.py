"""Paths and checks for the deployment artefacts (grafana/, deploy/, docs/runbooks.md).

External tools: promtool (Debian package `prometheus`) and kubectl (with its built-in kustomize).
A test that needs one skips, naming the missing binary, only when it is not installed.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES_FILE = ROOT / "deploy" / "prometheus" / "vllm-dp-exporter.rules.yml"
RULE_TESTS_DIR = ROOT / "deploy" / "prometheus" / "tests"
DASHBOARD_FILE = ROOT / "grafana" / "dashboards" / "vllm-dp-exporter.json"
KUSTOMIZE_DIR = ROOT / "deploy" / "kubernetes" / "base"
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RENDER_RULES_SCRIPT = ROOT / "deploy" / "prometheus" / "render_rules.py"
RUNBOOK_URL_PREFIX = "docs/runbooks.md#"

_METRIC_NAME = re.compile(r"\bvllm_dp_[A-Za-z0-9_]+")


def tool(name: str) -> str:
    """Absolute path of an external binary, or skip the calling test."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (see tests/harness/artefacts.py for the package)")
    return path


def run(
    args: list[str], timeout: float = 120, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run a command, failing the test (with its output) when it exits non-zero."""
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(args)} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
            f"stderr:\n{proc.stderr}"
        )
    return proc


def load_script(path: Path, name: str) -> ModuleType:
    """Import a standalone script (not on sys.path) as module `name`, freshly on every call.

    The module is not registered in sys.modules; its attributes are typed Any (ModuleType).
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def render_rules() -> ModuleType:
    """deploy/prometheus/render_rules.py, the generator of the rule files."""
    return load_script(RENDER_RULES_SCRIPT, "vllm_dp_render_rules")


def metric_names(expr: str) -> set[str]:
    """Every vllm_dp_* identifier in a PromQL expression."""
    return set(_METRIC_NAME.findall(expr))


def catalog_sample_names() -> set[str]:
    from exporter.metrics.catalog import METRICS, sample_names

    names: set[str] = set()
    for spec in METRICS:
        names.add(spec.name)
        names.update(sample_names(spec))
    return names


def load_rules() -> dict[str, Any]:
    rules: dict[str, Any] = yaml.safe_load(RULES_FILE.read_text(encoding="utf-8"))
    return rules


def alerting_rules() -> list[dict[str, Any]]:
    return [rule for group in load_rules()["groups"] for rule in group["rules"] if "alert" in rule]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    slug = heading.strip().lower()
    slug = re.sub(r"[^\w\- ]", "", slug)
    return slug.replace(" ", "-")


def runbook_sections() -> dict[str, str]:
    """Anchor -> section text, for every `## ` heading of docs/runbooks.md."""
    sections: dict[str, str] = {}
    current = None
    for line in RUNBOOKS.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            current = github_anchor(line[3:])
            sections[current] = ""
        elif current is not None:
            sections[current] += line + "\n"
    return sections
