"""No number of this project's tracker in what a user's clone holds: a clone has no tracker, so a
comment, test or page names the behaviour or the page that documents it instead. Upstream
threads (another project's pull request or issue) are cited by their project's name and number
("vLLM PR #48969", "llm-d-router #2514") or their address, never as a bare "issue N"."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
#: The trees and files a user's clone holds besides the build's own metadata.
SCANNED = ("exporter", "tests", "bench", "e2e", "tools", "docs", "deploy", "grafana", ".ci")
SCANNED_FILES = ("README.md", "Makefile", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yml", ".yaml", ".json", ".toml", ".txt", ".html", ".js", ".sh"}
SKIPPED_PARTS = {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
#: "issue 33", "issue #30", "Issues 32 and 34": this tracker's way of naming its work.
TRACKER_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def scanned_files() -> list[Path]:
    files = [ROOT / name for name in SCANNED_FILES if (ROOT / name).is_file()]
    for tree in SCANNED:
        for path in sorted((ROOT / tree).rglob("*")):
            if SKIPPED_PARTS & set(path.parts) or not path.is_file():
                continue
            if path.suffix in TEXT_SUFFIXES or path.parent.name == ".ci":
                files.append(path)
    return files


def tracker_mentions(text: str) -> list[str]:
    return [m.group(0) for m in TRACKER_NUMBER.finditer(text)]


def test_the_pattern_finds_what_it_should_and_nothing_else() -> None:
    assert tracker_mentions("the goals of issue 33; (issue #30, item 2); Issues 32 and 34") == [
        "issue 33",
        "issue #30",
        "Issues 32",
    ]
    assert tracker_mentions("vLLM PR #48969, llm-d-router #2514, .../issues/51433, tissue 3") == []


def test_no_tracker_number_in_code_tests_bench_or_docs() -> None:
    here = Path(__file__).resolve()
    found = []
    for path in scanned_files():
        if path == here:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for line_number, line in enumerate(text.splitlines(), 1):
            for mention in tracker_mentions(line):
                found.append(f"{path.relative_to(ROOT)}:{line_number}: {mention!r}")
    assert len(scanned_files()) > 100, "the scan found too few files to mean anything"
    assert found == [], "name the behaviour or its doc section instead:\n" + "\n".join(found)
