"""The house stays in order: imports point downward only, and git holds no generated files."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Collection
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

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
    # Each rank's row pushed to routers (GET /watch, the ZMQ load publisher).
    "feed": {"error", "base", "protocol", "client", "fleetstate"},
    "control": {"error", "base", "protocol", "config", "client", "fleetstate", "metrics", "feed"},
    "web": {"error", "base", "config", "client", "fleetstate", "metrics", "feed", "control"},
    "sim": {"error", "base", "protocol", "client"},
    # In-process mode's fronts (the vLLM endpoint plugin, the trainer API): what serve runs.
    "inprocess": {"error", "base", "config", "client", "metrics", "feed", "control", "web"},
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
    """``exporter.client.owner.transport`` → ``client``; the root package → ``""``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def exporter_modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted((ROOT / "exporter").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found.append((module, path))
    return found


def imported_names(path: Path, known: Collection[str] = ()) -> set[str]:
    """Every module ``path`` imports, even inside functions (and under ``TYPE_CHECKING``):
    ``from p import m`` names the module ``p.m`` when it is one of ``known``, else ``p``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def imports() -> list[tuple[str, str]]:
    """(importing module, imported module) for every exporter-internal import, even inside
    functions."""
    modules = exporter_modules()
    known = {m for m, _ in modules}
    return [
        (module, n)
        for module, path in modules
        for n in imported_names(path, known)
        if n == "exporter" or n.startswith("exporter.")
    ]


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


def path_between(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The modules from ``start`` to ``goal`` along imports (breadth first), or None."""
    came_from: dict[str, str] = {start: start}
    queue = [start]
    for here in queue:
        if here == goal:
            path = [here]
            while here != start:
                here = came_from[here]
                path.append(here)
            return path[::-1]
        for there in sorted(graph.get(here, ())):
            if there not in came_from:
                came_from[there] = here
                queue.append(there)
    return None


def test_no_two_modules_import_each_other() -> None:
    """No circle among the modules either, of any length, whether the imports are at the top,
    inside functions or under ``TYPE_CHECKING``: every module reads knowing only those below
    it (a type one module needs from another that needs it lives in a third, lower one)."""
    graph: dict[str, set[str]] = {}
    for importer, imported in imports():
        if imported != importer:
            graph.setdefault(importer, set()).add(imported)
    circles = set()
    for importer, imported in sorted((a, b) for a, bs in graph.items() for b in bs):
        back = path_between(graph, imported, importer)
        if back is not None:
            circle = [importer, *back]
            first = circle.index(min(circle[:-1]))
            circles.add(" -> ".join(circle[first:-1] + circle[: first + 1]))
    assert not circles, "import circles:\n" + "\n".join(sorted(circles))


def test_no_class_name_is_defined_twice() -> None:
    """One name, one class across ``exporter/``: a reader (or a training script importing
    ``exporter.remote``) never meets two different types under one name."""
    where: dict[str, list[str]] = {}
    for module, path in exporter_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, "\n".join(f"{n}: {', '.join(m)}" for n, m in sorted(twice.items()))


#: The trees beside ``exporter/`` (by their top-level package) and the ones each may import
#: besides itself: the shipped package imports none of them; the e2e harness runs the exporter
#: (the embedded trainer's ``start_exporter``) beside real vLLM; the benchmarks reuse the e2e
#: harness (processes, ports, vLLM runtimes); the tests may use every tree.
TREES: dict[str, set[str]] = {
    "exporter": set(),
    "tools": {"exporter"},
    "e2e": {"exporter", "examples"},
    "bench": {"exporter", "e2e"},
    # The example router: a user's program, reading the exporter only through its feed.
    "examples": set(),
    "tests": {"exporter", "tools", "e2e", "bench", "examples"},
}


def test_the_support_trees_import_only_downward() -> None:
    wrong = []
    for tree, allowed in TREES.items():
        for path in sorted((ROOT / tree).rglob("*.py")):
            for name in sorted(imported_names(path)):
                top = name.split(".")[0]
                if top in TREES and top != tree and top not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == [], "\n".join(wrong)


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


#: The attach-mode packages of ``exporter/client/`` and the other ones each may use (besides the
#: client's shared modules, ``fleet``, ``fake``, ``pushes`` and ``observe``): modes never import
#: each other.
CLIENT_MODES: dict[str, set[str]] = {
    "enginecore": set(),
    "owner": {"enginecore"},
    "relay": {"enginecore"},
    "http": set(),
    "inprocess": set(),
}


def client_mode_of(module: str) -> str | None:
    parts = module.split(".")
    return (
        parts[2] if len(parts) > 2 and parts[1] == "client" and parts[2] in CLIENT_MODES else None
    )


def test_the_attach_modes_do_not_import_each_other() -> None:
    wrong = []
    for importer, imported in imports():
        mine, theirs = client_mode_of(importer), client_mode_of(imported)
        if mine is not None and theirs not in (None, mine) and theirs not in CLIENT_MODES[mine]:
            wrong.append(f"{importer} imports {imported}")
    assert wrong == [], "\n".join(wrong)


def test_nothing_above_the_client_knows_the_transport_or_the_mode_name() -> None:
    """ZMQ is the client's (and the simulated engines') business; the layers above ask the
    client's capabilities, never ``config.attach``, which only the composition root reads. The
    one exception faces routers, not engines: the load publisher's own PUB sockets."""
    wrong = []
    for module, path in exporter_modules():
        package = package_of(module)
        if package in ("client", "sim", "config") or module in (
            "exporter.control.attach",
            "exporter.feed.publisher",
        ):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import) and any(
                a.name.split(".")[0] == "zmq" for a in node.names
            ):
                wrong.append(f"{module} imports zmq")
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zmq":
                wrong.append(f"{module} imports zmq")
            if package != "commands" and isinstance(node, ast.Compare):
                left = node.left
                if isinstance(left, ast.Attribute) and left.attr == "attach":
                    wrong.append(f"{module}:{node.lineno} compares the attach mode")
    assert wrong == [], "\n".join(wrong)
