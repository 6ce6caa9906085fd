"""The house stays in order: imports point downward only, and git holds no generated files."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Bottom first. A module may import from its own group and from lower layers only; the
#: picture in docs/architecture.md is this list.
LAYERS: list[set[str]] = [
    {"exporter", "exporter.error"},
    {
        "exporter.faults",
        "exporter.metrics_catalog",
        "exporter.ports",
        "exporter.negotiation",
        "exporter.config_rules",
        "exporter.httpguard",
        "exporter.admin_guard",
        "exporter.checksums",
        "exporter.logs",
        "exporter.webconfig",
        "exporter.eventloop",
    },
    {
        "exporter.tasks",
        "exporter.protocol",
        "exporter.fleet",
        "exporter.config",
        "exporter.basicauth",
    },
    {
        "exporter.transport",
        "exporter.aggregate",
        "exporter.invariants",
        "exporter.fake",
        "exporter.history",
    },
    {"exporter.client", "exporter.snapshot", "exporter.stats", "exporter.actions"},
    {"exporter.attach", "exporter.counted", "exporter.poller", "exporter.metrics", "exporter.gate"},
    {"exporter.exposition", "exporter.statusdoc"},
    {"exporter.runtime", "exporter.statuspage"},
    {"exporter.reset"},
    {"exporter.admin"},
    {"exporter.server"},
    {"exporter.service", "exporter.probe", "exporter.ctl"},
    {"exporter.sim"},
    {"exporter.demo"},
    {"exporter.cli"},
    {"exporter.__main__"},
]
PACKAGES = ("protocol", "transport", "sim", "demo")


def group(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in PACKAGES:
        return f"exporter.{parts[1]}"
    return ".".join(parts[:2])


def layer_of(name: str) -> int:
    for rank, members in enumerate(LAYERS):
        if name in members:
            return rank
    raise AssertionError(f"{name} is in no layer: add it to LAYERS and docs/architecture.md")


def imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every exporter-internal import, even inside
    functions."""
    found = []
    for path in (ROOT / "exporter").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(module, n) for n in names if n == "exporter" or n.startswith("exporter.")]
    return found


def test_every_import_points_downward() -> None:
    upward = []
    for importer, imported in imports():
        src, dst = group(importer), group(imported)
        if src != dst and layer_of(dst) >= layer_of(src):
            upward.append(f"{importer} imports {imported}")
    assert not upward, "\n".join(upward)


def test_the_transports_know_nothing_above_them() -> None:
    """The claim of the issue that made the layering true, spelled out."""
    for importer, imported in imports():
        if group(importer) == "exporter.transport":
            assert group(imported) not in {
                "exporter.client",
                "exporter.config",
                "exporter.stats",
                "exporter.runtime",
                "exporter.attach",
            }, f"{importer} imports {imported}"


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


GENERATED_DIRS = {
    ".venv",
    "venv",
    "site-packages",
    "__pycache__",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "node_modules",
}


def test_nothing_generated_or_vendored_is_tracked() -> None:
    bad = [p for p in tracked_files() if GENERATED_DIRS & set(Path(p).parts[:-1])]
    assert not bad, f"tracked files under a virtual environment or cache folder: {bad[:5]}"


def test_no_tracked_file_is_over_one_mib() -> None:
    big = [p for p in tracked_files() if (ROOT / p).is_file() and (ROOT / p).stat().st_size > 2**20]
    assert not big, f"tracked files over 1 MiB: {big}"
