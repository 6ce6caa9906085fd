"""The README and every page under docs/ link only to files (and headings) that exist, the index
docs/README.md links every page, and the benchmarks write the pages the index links."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
_EXTERNAL = ("http://", "https://", "mailto:")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text, lower case, without punctuation, spaces as -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    text = page.read_text()
    for line in prose_lines(text):
        match = _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    found.update(_HTML_ANCHOR.findall(text))
    return found


def links(page: Path) -> list[str]:
    """Every relative link target of a page (image links too), outside code."""
    found = []
    for line in prose_lines(page.read_text()):
        for target in _LINK.findall(_INLINE_CODE.sub("", line)):
            if not target.startswith(_EXTERNAL):
                found.append(target)
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / unquote(path)).resolve() if path else page), anchor


def test_every_relative_link_points_at_a_file_and_heading_that_exist() -> None:
    broken = []
    checked = 0
    for page in pages():
        for target in links(page):
            checked += 1
            path, anchor = resolve(page, target)
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not path.exists():
                broken.append(f"{where}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{where}: no such heading in {path.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert checked > 100


def test_the_index_links_every_page_of_docs() -> None:
    linked = {resolve(INDEX, target)[0] for target in links(INDEX)}
    missing = [
        str(page.relative_to(ROOT))
        for page in sorted(DOCS.rglob("*.md"))
        if page != INDEX and page.resolve() not in linked
    ]
    assert not missing, f"docs/README.md does not link: {missing}"


def test_the_readme_links_the_index_and_is_short() -> None:
    readme = ROOT / "README.md"
    assert INDEX.resolve() in {resolve(readme, target)[0] for target in links(readme)}
    assert len(readme.read_text().splitlines()) <= 200


def test_slug_follows_github() -> None:
    assert slug("In a trainer: `start_exporter`") == "in-a-trainer-start_exporter"
    assert slug("The page (`GET /`)") == "the-page-get-"
    assert slug("`--web-config-file`: TLS and basic auth") == "--web-config-file-tls-and-basic-auth"
    assert slug("From Python: `exporter.remote`") == "from-python-exporterremote"


def test_benchmarks_write_the_pages_the_index_links() -> None:
    """The benchmark pages are written by bench/*.py (and compared through the Makefile's
    BENCH_ARGS): every docs path those name exists."""
    sources = [ROOT / "Makefile", *sorted((ROOT / "bench").glob("*.py"))]
    named = {
        (source.name, path)
        for source in sources
        for path in re.findall(r"\bdocs/[\w./-]+\.md\b", source.read_text())
    }
    assert ("Makefile", "docs/benchmarks/before.md") in named
    assert ("run.py", "docs/benchmarks/README.md") in named
    assert ("plugin_loop.py", "docs/benchmarks/plugin-loop.md") in named
    assert ("plugin_cost.py", "docs/benchmarks/inprocess.md") in named
    missing = sorted(f"{name}: {path}" for name, path in named if not (ROOT / path).exists())
    assert not missing, missing
