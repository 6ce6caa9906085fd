"""The status page's elastic-EP lines (docs/status.md) in a real browser (headless Chromium):
HTTP mode over three simulated API servers, one operation under way, one failed, one server
answering as vLLM's Rust front end. The page's script draws the same lines as the server's
render, and hides them again once every operation is idle."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.harness.apiservers import ApiServers, http_config
from tests.harness.browser import Dom, descendants, dump_dom, find_chromium
from tests.harness.service import Service, Services
from tests.harness.statusschema import validate_status

CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed"),
]


@pytest.fixture
async def servers() -> AsyncIterator[ApiServers]:
    made = ApiServers()
    yield made
    await made.close()


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    made = Services(start=False)
    yield made
    await made.close()


def lines(dom: Dom) -> tuple[bool, list[tuple[str, str, str]]]:
    """Whether the section shows, and its lines: (target, kind, text)."""
    section = dom.by_id("elastic-section")
    items = descendants(dom.by_id("elastic-ep"), "li")
    return "hidden" not in section.attrs, [
        (li.attrs["data-target"], li.attrs["class"], " ".join(li.text.split())) for li in items
    ]


async def both(ex: Service, tmp_path: Path, name: str) -> tuple[Dom, Dom]:
    """The server's render and the DOM after the page's script rebuilt it from /status."""
    assert CHROMIUM is not None
    for _ in range(2):
        await ex.fresh_poll()
    validate_status(await ex.status())
    async with ex.session.get(ex.url + "/") as resp:
        assert resp.status == 200
        server = Dom(await resp.text())
    run = await dump_dom(CHROMIUM, tmp_path / f"profile-{name}", ex.url + "/")
    assert "Content Security Policy" not in run.err and "Refused to" not in run.err, run.err
    dom = Dom(run.out)
    (body,) = dom.find_all(data_refresh_ms="5000")
    assert int(body.attrs["data-live"]) >= 1, "the page's script did not refresh from /status"
    return server, dom


async def test_the_script_draws_the_servers_lines_as_the_server_does(
    servers: ApiServers, services: Services, tmp_path: Path
) -> None:
    apis = [
        await servers.start(engines=1),
        await servers.start(engines=1, story_offset=1),
        await servers.start(engines=1, story_offset=2, rust_front_end="0.33.0"),
    ]
    targets = [f"{n}={a.url}" for n, a in zip(("a", "b", "c"), apis, strict=True)]
    ex = await services.serve(http_config(targets))
    apis[0].sim.set_elastic_ep("committing", epoch="7", requested=4)
    apis[1].sim.set_elastic_ep("failed", epoch="9c2e", error="<b>rank 3</b> left")
    server, dom = await both(ex, tmp_path, "busy")
    assert lines(dom) == lines(server)
    shown, drawn = lines(dom)
    assert shown
    assert drawn == [
        ("a", "ee-committing", "a: committing, serving paused, to DP size 4, epoch 7"),
        ("b", "ee-failed", "b: failed, epoch 9c2e, error: <b>rank 3</b> left"),
        ("c", "ee-unknown", "c: unsupported here: HTTP 501 from POST /is_scaling_elastic_ep"),
    ]
    assert not descendants(dom.by_id("elastic-ep"), "b")  # text, never markup

    for api in apis:
        api.sim.set_elastic_ep("idle")
    server, dom = await both(ex, tmp_path, "idle")
    assert lines(dom) == lines(server) == (False, [])
