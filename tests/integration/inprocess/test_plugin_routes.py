"""The ``dp_exporter`` endpoint plugin's routes on a real FastAPI app served by uvicorn on
127.0.0.1, over real HTTP, with a simulated vLLM ``AsyncLLM`` and simulated engines on real ZMQ
sockets (``tests.harness.plugin_app``).

Routes: ``/dp/status`` (the published schema, one entry per engine), the page, the redirect,
the gate, ``/dp/readyz``, ``/metrics`` (vLLM's series first, then the per-engine ones) and the
app's OpenAPI document. Admin: refused without the plugin's own token (nothing reaches an
engine), the admin listener's guards with it. Robustness: a bad setting, vLLM's render server
(no engine client), a vLLM without what this mode needs, and the end of the app's lifespan never
raise into vLLM and leave every route answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI

from exporter.control.actions import ACTIONS
from exporter.fleetstate.invariants import READS
from exporter.inprocess.plugin import DpExporterPlugin
from exporter.inprocess.routes import NO_TOKEN
from exporter.sim.options import RequestHook, SimOptions, SimReply
from tests.harness.plugin_app import (
    TOKEN,
    VLLM_MARKER,
    PluginApp,
    PluginApps,
    raw_request,
    serve,
    server_url,
    stop_server,
)
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.statusschema import validate_status

AppFactory = PluginApps
#: What every poll asks each engine: anything else an engine received came from an action.
POLL_METHODS = frozenset(inv.method for inv in READS)


def token_file(tmp_path: Path) -> str:
    path = tmp_path / "admin-token"
    path.write_text(TOKEN + "\n")
    return str(path)


def action_calls(app: PluginApp) -> list[list[str]]:
    """Per engine, every method it answered that no poll asks."""
    assert app.fleet is not None
    return [[m for m, _ in e.received if m not in POLL_METHODS] for e in app.fleet.engines]


# -- read routes -------------------------------------------------------------------------------


async def test_status_is_the_status_document_with_one_entry_per_engine(
    plugin_apps: AppFactory,
) -> None:
    app = await plugin_apps(3, by_index={1: SimOptions(sleeping=True)})
    status, headers, _ = await app.get("/dp/status")
    assert status == 200 and headers["Cache-Control"] == "no-store"
    assert headers["Content-Type"].startswith("application/json")
    status, doc = await app.get_json("/dp/status")
    validate_status(doc)
    assert doc["attach"] == "inprocess"
    assert doc["ready"] is True
    assert doc["engines_expected"] == doc["engines_connected"] == 3
    assert [str(e["engine"]) for e in doc["engines"]] == ["0", "1", "2"]
    assert doc["aggregate"]["is_sleeping"]["consistent"] is False
    assert doc["last_poll"]["number"] >= 1


async def test_page_redirect_readyz_and_openapi(plugin_apps: AppFactory) -> None:
    app = await plugin_apps(2)
    status, headers, text = await app.get("/dp/")
    assert status == 200
    assert headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"] and headers["Cache-Control"] == "no-store"
    assert text.lstrip().lower().startswith("<!doctype html")
    status, headers, _ = await app.get("/dp")
    assert status == 308 and headers["Location"] == "/dp/"
    status, body = await app.get_json("/dp/readyz")
    assert status == 200
    assert body["ready"] is True
    assert body["engines_expected"] == body["engines_connected"] == 2
    assert body["last_poll"] >= 1

    status, spec = await app.get_json("/openapi.json")
    assert status == 200
    paths = spec["paths"]
    for path in ("/dp/status", "/dp/", "/dp/gate", "/dp/readyz", "/metrics"):
        assert "get" in paths.get(path, {}), path
        assert paths[path]["get"]["tags"] == ["dp_exporter"], path
    for name in ACTIONS:
        assert "post" in paths.get(f"/dp/admin/{name}", {}), name
    assert "/dp" not in paths  # the redirect is not an API


async def test_the_pages_own_links_answer_under_dp(plugin_apps: AppFactory) -> None:
    """The status page links to metrics, status, healthz and readyz relative to itself."""
    app = await plugin_apps(2)
    _, _, page = await app.get("/dp/")
    for link in ("metrics", "status", "healthz", "readyz"):
        assert f'href="{link}"' in page, link
        status, _, _ = await app.get(f"/dp/{link}")
        assert status == 200, link
    status, headers, text = await app.get("/dp/metrics")
    assert headers["Content-Type"].startswith("text/plain")
    assert VLLM_MARKER not in text  # the vllm_dp_* series alone
    assert metric_value(parse_metrics(text), "vllm_dp_engine_up", engine="1") == 1.0


async def test_a_failing_render_of_ours_never_costs_vllm_its_metrics(
    plugin_apps: AppFactory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    app = await plugin_apps(2)

    def broken() -> Any:
        raise ValueError("a bug in the series")

    assert app.runtime.exporter is not None
    monkeypatch.setattr(app.runtime.exporter.collector, "family_steps", broken)
    with caplog.at_level(logging.ERROR, logger="exporter.inprocess"):
        text = await app.metrics()
    assert f"{VLLM_MARKER} 42.0" in text.splitlines()
    assert "vllm_dp_" not in text
    assert any("could not be rendered" in r.getMessage() for r in caplog.records)


async def test_gate_ok_failing_and_bad_queries(plugin_apps: AppFactory) -> None:
    app = await plugin_apps(3, by_index={2: SimOptions(sleeping=True)})
    status, body = await app.get_json("/dp/gate")
    assert status == 200 and body["ok"] is True  # no condition: every engine answered
    status, body = await app.get_json("/dp/gate?sleeping=false")
    assert status == 412 and body["ok"] is False
    assert body["failing_engines"] == ["2"]
    status, body = await app.get_json("/dp/gate?sleeping=false&paused=false")
    assert status == 412 and body["conditions"] == {"sleeping": False, "paused": False}
    assert app.fleet is not None
    woken = app.fleet.engines[2].state
    woken.sleeping_tags, woken.paused = set(), False
    await asyncio.sleep(0.3)  # past the gate's 0.2 s sample reuse: a fresh fan-out
    status, body = await app.get_json("/dp/gate?sleeping=false&paused=false")
    assert status == 200 and body["ok"] is True and body["failing_engines"] == []
    for query, words in (
        ("bogus=1", "unknown condition 'bogus'"),
        ("sleeping=maybe", "must be true, false, 1 or 0"),
        ("sleeping=true&sleeping=false", "more than once"),
        ("weight_version=", "1-256 characters"),
    ):
        status, body = await app.get_json(f"/dp/gate?{query}")
        assert status == 400, query
        assert body["ok"] is False and words in body["error"], (query, body)


async def test_metrics_are_vllm_series_then_per_engine_series(plugin_apps: AppFactory) -> None:
    app = await plugin_apps(3, by_index={1: SimOptions(sleeping=True)})
    text = await app.metrics()
    lines = text.splitlines()
    vllm_line = lines.index(f"{VLLM_MARKER} 42.0")
    first_ours = next(i for i, line in enumerate(lines) if line.startswith("# HELP vllm_dp_"))
    assert vllm_line < first_ours
    families = parse_metrics(text)
    for engine in ("0", "1", "2"):
        assert metric_value(families, "vllm_dp_engine_up", engine=engine) == 1.0
    assert metric_value(families, "vllm_dp_engine_sleeping", engine="1") == 1.0
    assert metric_value(families, "vllm_dp_engine_sleeping", engine="0") == 0.0
    assert metric_value(families, "vllm_dp_engines_expected") == 3.0
    assert metric_value(families, "vllm_dp_engines_connected") == 3.0
    assert metric_value(families, "vllm_dp_sleep_state_consistent") == 0.0
    samples = [line.rsplit(" ", 1)[0] for line in lines if line and not line.startswith("#")]
    assert len(samples) == len(set(samples))  # no series twice


# -- admin -------------------------------------------------------------------------------------


async def test_admin_without_the_plugins_token_is_403_and_reaches_no_engine(
    plugin_apps: AppFactory,
) -> None:
    app = await plugin_apps(2)
    for name in ACTIONS:
        status, body, _ = await app.post(name, token="anything")
        assert status == 403, name
        assert body == {"error": NO_TOKEN}
    status, body, _ = await app.post("weight_version", data=b'{"weight_version": "v2"}')
    assert status == 403
    exporter = app.runtime.exporter
    assert exporter is not None
    # A poll that started after the refusals has been answered: nothing else was sent.
    await exporter.poller.wait_for_poll(exporter.poller.snapshot.poll_number, 5)
    assert action_calls(app) == [[], []]
    assert exporter.stats.admin_requests == {}  # refused before the guards: not counted
    assert "VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE" in NO_TOKEN


async def test_admin_with_token_wrong_401_right_200_per_engine(
    plugin_apps: AppFactory, env: Callable[..., None], tmp_path: Path
) -> None:
    env(ADMIN_TOKEN_FILE=token_file(tmp_path))
    app = await plugin_apps(3)
    status, body, headers = await app.post("reset_prefix_cache", token="wrong")
    assert status == 401 and body == {"error": "missing or invalid bearer token"}
    assert headers["WWW-Authenticate"].startswith("Bearer")
    status, body, _ = await app.post("reset_prefix_cache")
    assert status == 401
    assert action_calls(app) == [[], [], []]
    status, body, _ = await app.post("reset_prefix_cache", token=TOKEN)
    assert status == 200, body
    assert body["success"] is True and body["failed_engines"] == []
    assert body["engines"] == [
        {"engine": i, "ok": True, "reason": None, "error": None} for i in range(3)
    ]
    assert action_calls(app) == [["reset_prefix_cache"]] * 3
    families = parse_metrics(await app.metrics())
    assert (
        metric_value(families, "vllm_dp_admin_requests", action="reset_prefix_cache", code="401")
        == 2.0
    )
    assert (
        metric_value(families, "vllm_dp_admin_requests", action="reset_prefix_cache", code="200")
        == 1.0
    )


def refuse_reset_at(refusing: dict[str, int | None]) -> Callable[[int], RequestHook]:
    """Hooks by rank: the engine whose rank is ``refusing["rank"]`` answers False to a reset."""

    def hook_for(rank: int) -> RequestHook:
        def hook(client: int, call_id: int, method: str, args: list[Any]) -> SimReply | None:
            if method == "reset_prefix_cache" and refusing["rank"] == rank:
                return SimReply(value=False)
            return None

        return hook

    return hook_for


async def test_one_engine_refusing_at_any_position_is_502_naming_it(
    plugin_apps: AppFactory, env: Callable[..., None], tmp_path: Path
) -> None:
    env(ADMIN_TOKEN_FILE=token_file(tmp_path))
    refusing: dict[str, int | None] = {"rank": None}
    app = await plugin_apps(3, hook=refuse_reset_at(refusing))
    for position, rank in (("first", 0), ("middle", 1), ("last", 2)):
        refusing["rank"] = rank
        status, body, _ = await app.post("reset_prefix_cache", token=TOKEN)
        assert status == 502, (position, body)
        assert body["outcome"] == "partial_failure" and body["failed_engines"] == [rank]
        assert body["engines"][rank] == {
            "engine": rank,
            "ok": False,
            "reason": "refused",
            "error": None,
        }, position
        assert [e["ok"] for e in body["engines"]] == [i != rank for i in range(3)], position
    assert action_calls(app) == [["reset_prefix_cache"] * 3] * 3
    families = parse_metrics(await app.metrics())
    for engine in ("0", "1", "2"):
        assert (
            metric_value(
                families,
                "vllm_dp_prefix_cache_reset_engine_failures",
                engine=engine,
                reason="refused",
            )
            == 1.0
        )


async def test_admin_body_bound_bad_params_and_idempotency(
    plugin_apps: AppFactory, env: Callable[..., None], tmp_path: Path
) -> None:
    env(ADMIN_TOKEN_FILE=token_file(tmp_path))
    app = await plugin_apps(2)
    # Too large: declared (Content-Length) and chunked (no length: read up to the bound).
    status, body, _ = await app.post("weight_version", token=TOKEN, data=b"x" * 2000)
    assert (status, body) == (413, {"error": "request body too large"})

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(4):
            yield b"y" * 400

    status, body, _ = await app.post("weight_version", token=TOKEN, data=chunks())
    assert (status, body) == (413, {"error": "request body too large"})
    # Bad parameters: 400 naming them.
    for action, params, data, words in (
        ("sleep", {"level": "9"}, None, "level"),
        ("reset_prefix_cache", {"reset_connector": "maybe"}, None, "reset_connector"),
        ("reset_prefix_cache", {"bogus": "1"}, None, "bogus"),
        ("weight_version", {}, b"not json", "must be JSON"),
        ("resume", {}, b"{}", "takes no request body"),
    ):
        status, body, _ = await app.post(action, token=TOKEN, params=params, data=data)
        assert status == 400, (action, params, body)
        assert words in body["error"], (action, body)
    assert action_calls(app) == [[], []]
    # Idempotency-Key: the retry is the stored answer, the engines see one reset.
    key = {"Idempotency-Key": "step-41"}
    first = await app.post("reset_prefix_cache", token=TOKEN, headers=key)
    again = await app.post("reset_prefix_cache", token=TOKEN, headers=key)
    assert first[0] == again[0] == 200
    assert again[1] == first[1]
    assert again[2]["Idempotency-Replayed"] == "true"
    assert "Idempotency-Replayed" not in first[2]
    other = await app.post(
        "reset_prefix_cache", token=TOKEN, headers=key, params={"reset_connector": "true"}
    )
    assert other[0] == 422
    assert action_calls(app) == [["reset_prefix_cache"]] * 2
    # A good body still goes through.
    status, body, _ = await app.post(
        "weight_version", token=TOKEN, data=b'{"weight_version": "v7"}'
    )
    assert status == 200, body
    assert app.fleet is not None
    assert all(e.args_of("set_weight_version") == [["v7"]] for e in app.fleet.engines)


def _post_head(action: str, *headers: bytes) -> bytes:
    head = b"POST /dp/admin/" + action.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    for header in headers:
        head += header + b"\r\n"
    return head + b"Content-Length: 0\r\nConnection: close\r\n\r\n"


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


async def test_hostile_header_bytes_are_401_not_500(
    plugin_apps: AppFactory, env: Callable[..., None], tmp_path: Path
) -> None:
    env(ADMIN_TOKEN_FILE=token_file(tmp_path))
    app = await plugin_apps(2)
    for value in (b"Bearer \xff\xfe\xc3(", b"\xff\xfe", b"Bearer " + TOKEN.encode() + b"\x80"):
        answer = await raw_request(
            app.port, _post_head("reset_prefix_cache", b"Authorization: " + value)
        )
        assert _status(answer) == 401, answer[:300]
        assert b"missing or invalid bearer token" in answer
    # The right token as raw bytes still works, and a key that is not UTF-8 is no crash.
    answer = await raw_request(
        app.port,
        _post_head(
            "reset_prefix_cache",
            b"Authorization: Bearer " + TOKEN.encode(),
            b"Idempotency-Key: \xff\xfe-key",
        ),
    )
    assert _status(answer) == 200, answer[:300]
    assert action_calls(app) == [["reset_prefix_cache"]] * 2


# -- robustness: never raises into vLLM, always answers ------------------------------------


async def assert_unavailable(app: PluginApp, words: str) -> None:
    """Every /dp route answers 503 naming the problem; /metrics is vLLM's alone."""
    for path in ("/dp/status", "/dp/", "/dp/gate", "/dp/readyz"):
        status, body = await app.get_json(path)
        assert status == 503, path
        assert body["ok"] is False and words in body["error"], (path, body)
    status, body, _ = await app.post("reset_prefix_cache", token=TOKEN)
    assert status == 503 and words in body["error"]
    text = await app.metrics()
    assert f"{VLLM_MARKER} 42.0" in text.splitlines()
    assert "vllm_dp_" not in text


async def test_bad_setting_never_raises_routes_503_metrics_still_vllms(
    plugin_apps: PluginApps,
    env: Callable[..., None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    env(POLL_INTERVAL="abc")
    with caplog.at_level(logging.ERROR, logger="exporter.inprocess"):
        app = await plugin_apps.bare(SimpleNamespace(engine_core=None))
    problem = app.runtime.problem
    assert problem is not None and problem.startswith("the dp_exporter plugin did not start")
    assert "poll_interval" in problem.lower() or "POLL_INTERVAL" in problem, problem
    assert "abc" in problem
    await assert_unavailable(app, "abc")
    errors = [r for r in caplog.records if r.name == "exporter.inprocess"]
    assert [r.getMessage() for r in errors] == [problem]


async def test_render_server_without_engine_client_is_503(
    plugin_apps: PluginApps,
) -> None:
    app = await plugin_apps.bare(None)
    await assert_unavailable(app, "no engine (the render server)")


async def test_core_without_call_utility_async_is_one_clear_message(
    plugin_apps: PluginApps, caplog: pytest.LogCaptureFixture
) -> None:
    core = SimpleNamespace(
        core_engines=[b"\x00\x00"], utility_results={}, resources=SimpleNamespace(engine_dead=False)
    )
    with caplog.at_level(logging.WARNING, logger="exporter.inprocess"):
        app = await plugin_apps.bare(
            SimpleNamespace(engine_core=core, vllm_config=SimpleNamespace())
        )
    problem = app.runtime.problem
    assert problem is not None
    assert "lacks _call_utility_async" in problem, problem
    assert "Traceback" not in problem
    records = [r for r in caplog.records if r.name == "exporter.inprocess"]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].getMessage() == problem and records[0].exc_info is None
    await assert_unavailable(app, "lacks _call_utility_async")


async def test_lifespan_end_stops_the_exporter(plugin_apps: AppFactory) -> None:
    app = await plugin_apps(2)
    exporter = app.runtime.exporter
    assert exporter is not None
    poll_task = exporter._poll_task
    assert poll_task is not None and not poll_task.done()
    await stop_server(app.server, app.task)  # uvicorn exits: the app's lifespan ends
    assert poll_task.done()
    assert app.runtime.exporter is None
    assert app.runtime.problem is not None and "stopped" in app.runtime.problem
    # The same app served again without a lifespan: the routes say why they cannot answer.
    again = PluginApp(app.app, app.plugin, *await serve(app.app, lifespan="off"), "", app.session)
    again.url = server_url(again.server)
    try:
        await assert_unavailable(again, "stopped (vLLM is shutting down)")
    finally:
        await stop_server(again.server, again.task)


async def test_lifespan_wrapper_keeps_vllms_own_lifespan(env: Callable[..., None]) -> None:
    """vLLM's app has its own lifespan; the plugin's wrapper runs it whole, then stops."""
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def vllm_lifespan(application: FastAPI) -> AsyncIterator[None]:
        events.append("vllm up")
        yield
        events.append("vllm down")

    app = FastAPI(lifespan=vllm_lifespan)
    plugin = DpExporterPlugin()
    plugin.attach_router(app)
    await plugin.init_state(None, app.state, None)  # type: ignore[arg-type]
    server, task = await serve(app)
    assert events == ["vllm up"]
    await stop_server(server, task)
    assert events == ["vllm up", "vllm down"]
    assert plugin.runtime.problem is not None and "stopped" in plugin.runtime.problem
