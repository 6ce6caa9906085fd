"""Headless Chromium from the command line (Debian's ``chromium``): the DOM after the page's
script ran, and screenshots. No Playwright, no DevTools client: ``--dump-dom`` and
``--screenshot`` with a virtual-time budget, so the page's ``fetch`` and timers run before the
DOM is read.

Every run gets its own profile directory and no network beyond the URL asked for.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-extensions",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--enable-logging=stderr",
    "--v=0",
)
RUN_TIMEOUT_S = 60.0


def find_chromium() -> str | None:
    for name in CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class BrowserRun:
    out: str
    err: str


async def run_chromium(binary: str, profile: Path, *args: str, budget_ms: int = 3000) -> BrowserRun:
    profile.mkdir(parents=True, exist_ok=True)
    proc = await asyncio.create_subprocess_exec(
        binary,
        *FLAGS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if proc.returncode != 0:
        raise AssertionError(f"chromium exited {proc.returncode}: {err.decode()[-2000:]}")
    return BrowserRun(out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


async def dump_dom(binary: str, profile: Path, url: str) -> BrowserRun:
    return await run_chromium(binary, profile, "--dump-dom", url)


async def screenshot(
    binary: str, profile: Path, url: str, path: Path, size: tuple[int, int] = (1280, 1100)
) -> BrowserRun:
    run = await run_chromium(
        binary, profile, f"--window-size={size[0]},{size[1]}", f"--screenshot={path}", url
    )
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", run.err[-2000:]
    return run


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    children: list[Element] = field(default_factory=list)


class Dom(HTMLParser):
    """The serialized DOM as a small tree of ``Element``s (text is the concatenated text)."""

    VOID = frozenset({"meta", "link", "br", "img", "input", "hr", "col", "source", "wbr"})

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#root", {})
        self._stack = [self.root]
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Element(tag, {k: v or "" for k, v in attrs})
        self._stack[-1].children.append(node)
        if tag not in self.VOID:
            self._stack.append(node)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._stack[-1].children.append(Element(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i].tag == tag:
                del self._stack[i:]
                return

    def handle_data(self, data: str) -> None:
        for node in self._stack[1:]:
            node.text += data

    def find_all(self, **attrs: str) -> list[Element]:
        found: list[Element] = []

        def walk(node: Element) -> None:
            for child in node.children:
                if all(child.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items()):
                    found.append(child)
                walk(child)

        walk(self.root)
        return found

    def by_id(self, element_id: str) -> Element:
        found = self.find_all(id=element_id)
        assert len(found) == 1, f"{len(found)} elements with id {element_id!r}"
        return found[0]


def descendants(node: Element, tag: str) -> list[Element]:
    out: list[Element] = []
    for child in node.children:
        if child.tag == tag:
            out.append(child)
        out.extend(descendants(child, tag))
    return out
