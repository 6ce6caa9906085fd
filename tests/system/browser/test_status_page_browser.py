"""The status page (docs/status.md) in a real browser (headless Chromium) and /status against its
schema, for a fleet in each state: consistent (one engine with work), inconsistent (after a
partly failed admin action), unknown (an engine that stopped answering) and one engine down
(disconnected).

The DOM is read after the page's script fetched /status and rebuilt the sections (``data-live``
counts those refreshes), so the no-JS render and the script's render are both checked. A
screenshot of each state is saved in the test's tmp dir (and copied into the directory named by
``VLLM_DP_SCREENSHOT_DIR`` when set: how docs/images/status-page.png is made).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from exporter.client.fleet import connected_count
from exporter.fleetstate.history import FleetHistory
from exporter.sim.options import SimOptions
from tests.harness.browser import Dom, descendants, dump_dom, find_chromium, screenshot
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

CHROMIUM = find_chromium()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),  # about 4 s per Chromium start, two per state
    pytest.mark.skipif(
        CHROMIUM is None,
        reason="headless Chromium is not installed (Debian: apt-get install chromium; "
        ".ci/run installs it)",
    ),
]
METHODS = ("is_sleeping", "is_scheduler_paused", "get_weight_version")


def seed_history(fleet: Service) -> None:
    """An hour of earlier buckets (a short inconsistency 40 minutes ago, an engine down 20
    minutes ago), so the timeline in the screenshots has something to show."""
    history = FleetHistory()
    now = time.time()
    ok = dict.fromkeys(METHODS, "consistent")
    for minutes in range(60, 0, -1):
        unix = now - minutes * 60
        states, up = dict(ok), 4
        if 38 <= minutes <= 41:
            states["get_weight_version"] = "inconsistent"
        if 18 <= minutes <= 20:
            states = dict.fromkeys(METHODS, "unknown")
            up = 3
        history.record(unix, states, up, 4)
    fleet.exporter.poller.history = history


async def load(fleet: Service, tmp_path: Path, name: str) -> Dom:
    """The page after its script ran, checked against the server's own render and the schema;
    a screenshot of it in tmp_path."""
    assert CHROMIUM is not None
    await fleet.fresh_poll()
    validate_status(await fleet.status())
    async with fleet.session.get(fleet.url + "/") as resp:
        assert resp.status == 200
        assert "script-src 'sha256-" in resp.headers["Content-Security-Policy"]
        server = Dom(await resp.text())
    run = await dump_dom(CHROMIUM, tmp_path / f"profile-{name}", fleet.url + "/")
    assert "Content Security Policy" not in run.err and "Refused to" not in run.err, run.err
    dom = Dom(run.out)
    (body,) = dom.find_all(data_refresh_ms="5000")
    assert int(body.attrs["data-live"]) >= 1, "the page's script did not refresh from /status"
    # The script draws the same banners and rows as the server (ages aside), cell for cell
    # where a cell is the engine's fault-tolerance status or activity.
    for method in METHODS:
        assert _words(dom, method) == _words(server, method)
    assert _rows(dom) == _rows(server)
    assert _cell_counts(dom) == _cell_counts(server)
    assert activity(dom) == activity(server)
    shot = tmp_path / f"status-page-{name}.png"
    await screenshot(CHROMIUM, tmp_path / f"profile-{name}-shot", fleet.url + "/", shot)
    target = os.environ.get("VLLM_DP_SCREENSHOT_DIR")
    if target:
        shutil.copy(shot, Path(target) / shot.name)
    return dom


def _words(dom: Dom, method: str) -> tuple[str, str]:
    banner = dom.by_id(f"v-{method}")
    return banner.attrs["data-state"], " ".join(banner.text.split())


def _rows(dom: Dom) -> list[tuple[str, str, str]]:
    rows = descendants(dom.by_id("engine-rows"), "tr")
    return [(r.attrs["data-engine"], r.attrs["data-up"], r.attrs.get("class", "")) for r in rows]


def _cell_counts(dom: Dom) -> list[int]:
    return [len(descendants(r, "td")) for r in descendants(dom.by_id("engine-rows"), "tr")]


def activity(dom: Dom) -> list[tuple[str, str]]:
    """Each row's activity cell: (kind, text), kind ``busy``, ``drained`` or ``unknown``."""
    cells = [c for c in descendants(dom.by_id("engine-rows"), "td") if "data-activity" in c.attrs]
    return [(c.attrs["data-activity"], c.text) for c in cells]


def banner(dom: Dom, method: str) -> str:
    state, text = _words(dom, method)
    return f"{state}: {text}"


async def test_status_page_in_every_fleet_state(
    fleet_factory: ServiceFactory, tmp_path: Path
) -> None:
    fleet = await fleet_factory(
        4,
        model_name="llama-70b",
        options=SimOptions(weight_version="step-41"),
        per_engine={"ignore_state_changes": {2: True}},
    )
    seed_history(fleet)
    fleet.engines[3].state.submit(600.0, time.monotonic(), 1)  # until the pause aborts it

    # Consistent: every banner says so in words, four rows, all up, no action yet; engine 3
    # has work (owner mode reads has_work; vLLM publishes no counts to it).
    dom = await load(fleet, tmp_path, "consistent")
    assert activity(dom) == [("drained", "drained")] * 3 + [("busy", "has work")]
    assert (
        banner(dom, "is_sleeping")
        == "consistent: ✔ Sleep state is_sleeping CONSISTENT false (awake)"
    )
    assert banner(dom, "get_weight_version").endswith("CONSISTENT step-41")
    assert _rows(dom) == [(e, "true", "") for e in "0123"]
    assert "No admin action since start." in dom.by_id("last-action").text
    assert len(descendants(dom.by_id("timeline"), "rect")) > 60

    # Inconsistent: a pause that engine 2 ignored, and a new weight version on engine 0 only.
    assert fleet.admin_url is not None
    async with fleet.session.post(fleet.admin_url + "/admin/pause") as resp:
        assert resp.status == 502
    fleet.engines[0].state.weight_version = "step-42"
    dom = await load(fleet, tmp_path, "inconsistent")
    paused = banner(dom, "is_scheduler_paused")
    assert paused.startswith("inconsistent: ✖ Scheduler paused is_scheduler_paused INCONSISTENT")
    assert "engine 2: false" in paused and "engine 0: true" in paused
    assert "engine 0: step-42 · engine 1: step-41" in banner(dom, "get_weight_version")
    action = dom.by_id("last-action").text
    assert "pause — PARTIAL_FAILURE (HTTP 502)" in " ".join(action.split())
    results = {
        r.children[0].text: r.children[1].text
        for r in descendants(dom.by_id("action-engines"), "tr")[1:]
    }
    assert results == {"0": "ok", "1": "ok", "2": "FAILED", "3": "ok"}
    counters = " ".join(dom.by_id("counters").text.split())
    assert "partial_failure 1" in counters and "is_scheduler_paused" in counters
    async with fleet.session.post(fleet.admin_url + "/admin/resume") as resp:
        assert resp.status == 200
    fleet.engines[0].state.weight_version = "step-41"

    # Unknown: engine 1 stops answering (still connected): unknown, never a value.
    fleet.engines[1].options.hang = True
    dom = await load(fleet, tmp_path, "unknown")
    for method in METHODS:
        assert banner(dom, method).startswith("unknown: ? ")
        assert banner(dom, method).endswith("UNKNOWN no answer from engine 1")
    assert _rows(dom)[1] == ("1", "false", "down")
    assert activity(dom)[1] == ("unknown", "unknown")
    assert activity(dom)[3] == ("drained", "drained")  # the pause (abort) dropped its work
    fleet.engines[1].options.hang = False

    # One engine down: engine 3 exits; its row says DOWN (disconnected).
    fleet.engines[3].options.shutdown_window_s = 0.0
    fleet.engines[3].stop()
    await eventually(lambda: connected_count(fleet.exporter.client) == 3, what="engine 3 gone")
    dom = await load(fleet, tmp_path, "engine-down")
    rows = _rows(dom)
    assert len(rows) == 4 and rows[3] == ("3", "false", "down")
    assert [r[1] for r in rows[:3]] == ["true"] * 3
    down = descendants(descendants(dom.by_id("engine-rows"), "tr")[3], "td")
    assert [down[0].text, down[1].text] == ["3", "DOWN (disconnected)"]
    assert banner(dom, "is_sleeping").endswith("no answer from engine 3")
    assert "connected 3/4" in dom.by_id("summary").text
    assert {p.name for p in tmp_path.glob("*.png")} == {
        f"status-page-{n}.png" for n in ("consistent", "inconsistent", "unknown", "engine-down")
    }


async def test_status_page_escapes_engine_strings(
    fleet_factory: ServiceFactory, tmp_path: Path
) -> None:
    """A hostile vLLM version and weight version reach the DOM as text, never as markup."""
    assert CHROMIUM is not None
    hostile = "<img src=x onerror=document.title='pwned'>"
    fleet = await fleet_factory(2, options=SimOptions(vllm_version=hostile, weight_version=hostile))
    dom = await load(fleet, tmp_path, "hostile")
    assert not dom.find_all(src="x")
    assert "pwned" not in (dom.find_all(id="title")[0].text)
    assert hostile in dom.by_id("engine-rows").text
    assert hostile in banner(dom, "get_weight_version")
