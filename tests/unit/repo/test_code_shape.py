"""The shape that keeps the code easy to live in, kept by a test rather than by a review: short
functions, test modules a reader can hold, and a unit test module of its own for most modules
(``tests/unit/<package>/test_<module>.py``), the wire packages included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
EXPORTER = ROOT / "exporter"
#: The longest function or method of ``exporter/``, in lines (decorators and docstring included).
MAX_FUNCTION_LINES = 60
#: The longest test module, harness modules included.
MAX_TEST_MODULE_LINES = 600
#: The share of ``exporter/`` modules with a mirrored unit test module, at least.
MIN_MIRRORED = 0.70
#: The packages whose modules must all be counted (the wire packages among them).
WIRE_PACKAGES = ("client/enginecore", "client/owner", "client/relay", "protocol")


def functions_over(limit: int, path: Path, base: Path = ROOT) -> list[str]:
    """``path::name (N lines)`` of every function longer than ``limit`` lines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = (node.end_lineno or node.lineno) - first + 1
            if length > limit:
                found.append(f"{path.relative_to(base)}::{node.name} ({length} lines)")
    return found


def product_modules() -> list[Path]:
    return sorted(p for p in EXPORTER.rglob("*.py") if "__pycache__" not in p.parts)


def mirrored_test(module: Path) -> Path:
    relative = module.relative_to(EXPORTER)
    return ROOT / "tests" / "unit" / relative.parent / f"test_{relative.name}"


def test_no_function_is_over_the_limit() -> None:
    long = [f for path in product_modules() for f in functions_over(MAX_FUNCTION_LINES, path)]
    assert long == [], "split these into named steps:\n" + "\n".join(long)


def test_the_function_rule_sees_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    sample = tmp_path / "sample.py"
    short = "def short() -> None:\n    pass\n"
    sample.write_text(f"@staticmethod\ndef long() -> None:\n{body}\n\n{short}")
    assert functions_over(MAX_FUNCTION_LINES, sample, tmp_path) == [
        f"sample.py::long ({MAX_FUNCTION_LINES + 2} lines)"
    ]


def test_no_test_module_is_over_the_limit() -> None:
    long = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        lines = path.read_text(encoding="utf-8").count("\n")
        if lines > MAX_TEST_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
    assert long == [], "split these by what they test:\n" + "\n".join(long)


def test_most_modules_have_a_unit_test_module_of_their_own() -> None:
    modules = [p for p in product_modules() if p.name != "__init__.py"]
    mirrored = [p for p in modules if mirrored_test(p).is_file()]
    share = len(mirrored) / len(modules)
    missing = sorted(str(p.relative_to(EXPORTER)) for p in modules if p not in mirrored)
    assert share >= MIN_MIRRORED, f"{share:.0%} mirrored; without one: {missing}"
    for package in WIRE_PACKAGES:
        own = [p for p in modules if str(p.relative_to(EXPORTER)).startswith(package + "/")]
        assert own, f"no module in {package}"
        assert any(p in mirrored for p in own), f"no module of {package} is mirrored"
