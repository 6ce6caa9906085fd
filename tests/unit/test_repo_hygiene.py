"""The house stays in order: imports point downward only, and git holds no generated files."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The packages of ``exporter/``, bottom first, and the packages each may import (besides its
#: own modules and the root package's ``__version__``). docs/architecture.md draws this graph.
PACKAGES: dict[str, set[str]] = {
    "error": set(),
    "base": {"error"},
    "protocol": {"error"},
    "config": {"error", "base"},
    "client": {"error", "base", "protocol"},
    "fleetstate": {"error", "protocol", "client"},
    "metrics": {"error", "base", "client", "fleetstate"},
    "control": {"error", "base", "protocol", "config", "client", "fleetstate", "metrics"},
    "web": {"error", "base", "config", "client", "fleetstate", "metrics", "control"},
    "sim": {"error", "base", "protocol", "client"},
    # In-process mode's fronts (the vLLM endpoint plugin, the trainer API): what serve runs.
    "embed": {"error", "base", "config", "client", "metrics", "control", "web"},
    # A client of the exporter's HTTP surface (ctl, the demo's trainer, training scripts): it
    # knows the exporter only through its answers, never its internals.
    "remote": {"error", "config"},
    "commands": {
        "error",
        "base",
        "protocol",
        "config",
        "client",
        "fleetstate",
        "control",
        "web",
        "sim",
        "remote",
    },
    "__main__": {"commands"},
}
#: Modules allowed at the top of ``exporter/`` (everything else lives in a package).
TOP_LEVEL = {"__init__.py", "__main__.py", "error.py"}


def package_of(module: str) -> str:
    """``exporter.client.transport.owner`` → ``client``; the root package → ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def exporter_modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted((ROOT / "exporter").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found.append((module, path))
    return found


def imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every exporter-internal import, even inside
    functions."""
    found = []
    for module, path in exporter_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found += [(module, n) for n in names if n == "exporter" or n.startswith("exporter.")]
    return found


def test_every_import_follows_the_package_rules() -> None:
    wrong = []
    for importer, imported in imports():
        src, dst = package_of(importer), package_of(imported)
        if dst in ("", src):
            continue
        if dst not in PACKAGES.get(src, set()):
            wrong.append(f"{importer} imports {imported} ({src} may not use {dst})")
    assert not wrong, "\n".join(wrong)


def test_the_package_graph_runs_one_way() -> None:
    """Each package uses only packages listed before it: no circle, one direction."""
    order = list(PACKAGES)
    for package, uses in PACKAGES.items():
        assert uses <= set(order[: order.index(package)]), package


def test_every_package_is_in_the_rules_and_the_top_level_stays_small() -> None:
    top = ROOT / "exporter"
    packages = {p.name for p in top.iterdir() if (p / "__init__.py").is_file()}
    assert packages == set(PACKAGES) - {"error", "__main__"}
    modules = {p.name for p in top.glob("*.py")}
    assert modules == TOP_LEVEL, f"modules outside a package: {sorted(modules - TOP_LEVEL)}"


def test_the_engine_facing_client_knows_nothing_above_it() -> None:
    """vLLM's Rust engine-core-client in our terms: the client package (fleet interface, fake,
    ZMQ and HTTP clients, transports) depends on the wire codec and the base modules only, so
    one more attach mode is one more implementation inside it."""
    for importer, imported in imports():
        if package_of(importer) == "client":
            assert package_of(imported) in {"", "client", "error", "base", "protocol"}, (
                f"{importer} imports {imported}"
            )


def architecture_map() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def test_the_architecture_map_names_every_module() -> None:
    text = architecture_map()
    missing = []
    for _, path in exporter_modules():
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" and not path.read_text().strip().count("\n"):
            continue  # a package marker with its docstring only
        if f"`{rel}`" not in text:
            missing.append(rel)
    assert not missing, f"docs/architecture.md does not name: {missing}"


def test_every_module_the_map_names_exists() -> None:
    named = set(re.findall(r"`(exporter/[\w/]+\.py)`", architecture_map()))
    assert named, "the map names no module"
    assert not [p for p in named if not (ROOT / p).is_file()], "the map names missing modules"


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
