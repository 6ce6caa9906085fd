"""Which front end each HTTP-mode target runs (docs/deployment-rust-front-end.md): vLLM's
Python API server, or its Rust front end (``GET /version`` adds ``rust_frontend_version``),
shown as ``vllm_dp_engine_info`` labels, in ``/status``, on the page and through the Python
client, over real HTTP."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from exporter.remote.status import Status
from tests.harness.apiservers import HOST, StartApi, http_config
from tests.harness.service import Service, ServiceFactory
from tests.integration.http.test_exporter_http import value


async def settled(ex: Service) -> dict[str, Any]:
    """``/status`` once every target's ``GET /version`` answer arrived (off the poll path)."""
    for _ in range(50):
        await ex.fresh_poll()
        doc = await ex.status()
        if all(e["vllm_version"] for e in doc["engines"]):
            return doc
    raise AssertionError("the targets' versions never arrived")


async def test_each_target_shows_the_front_end_it_runs(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    python = await start_api(engines=2)
    rust = await start_api(engines=2, rust_front_end="0.32.0")
    ex = await start_exporter(http_config([f"py={python.url}", f"rs={rust.url}"]))
    doc = await settled(ex)
    shown = {e["engine"]: (e["front_end"], e["rust_frontend_version"]) for e in doc["engines"]}
    assert shown == {"py": ("python", None), "rs": ("rust", "0.32.0")}
    text = await ex.metrics()
    info = dict(vllm_version="0.33.0")
    assert value(text, "vllm_dp_engine_info", engine="py", front_end="python", **info) == 1
    assert (
        value(
            text,
            "vllm_dp_engine_info",
            engine="rs",
            front_end="rust",
            rust_frontend_version="0.32.0",
            **info,
        )
        == 1
    )
    assert value(text, "vllm_dp_engine_info", engine="py", rust_frontend_version="unknown") == 1
    async with ex.session.get(f"{ex.url}/") as resp:
        page = await resp.text()
    assert "0.33.0 (Rust front end 0.32.0)" in page
    engines = {e.engine: e for e in Status.from_json(doc).engines}
    assert engines["rs"].front_end == "rust" and engines["rs"].rust_frontend_version == "0.32.0"
    assert engines["py"].front_end == "python" and engines["py"].rust_frontend_version is None


async def hostile_version_server(answer: Any) -> tuple[web.AppRunner, str]:
    """A server whose ``GET /version`` says ``answer`` and whose dev routes say nothing."""

    async def version(_: web.Request) -> web.Response:
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json")

    async def sleeping(_: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": False})

    app = web.Application()
    app.router.add_get("/version", version)
    app.router.add_get("/is_sleeping", sleeping)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://{HOST}:{port}"


async def test_a_hostile_rust_frontend_version_is_cut_or_unknown(
    start_exporter: ServiceFactory,
) -> None:
    long_one, url_long = await hostile_version_server(
        {"version": "0.33.0", "rust_frontend_version": "9" * 100_000}
    )
    typed, url_typed = await hostile_version_server(
        {"version": "0.33.0", "rust_frontend_version": {"nested": [1, 2, 3]}}
    )
    try:
        ex = await start_exporter(http_config([f"long={url_long}", f"typed={url_typed}"]))
        doc = await settled(ex)
        by = {e["engine"]: e for e in doc["engines"]}
        assert by["long"]["front_end"] == "rust"
        assert len(by["long"]["rust_frontend_version"].encode()) <= 256
        assert by["typed"]["front_end"] == "rust"
        assert by["typed"]["rust_frontend_version"] is None  # not a string: not known
        text = await ex.metrics()
        assert len(text) < 64 * 1024
        assert value(text, "vllm_dp_engine_info", engine="typed", front_end="rust") == 1
    finally:
        await long_one.cleanup()
        await typed.cleanup()
