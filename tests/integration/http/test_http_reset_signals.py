"""HTTP mode over real HTTP against simulated vLLM API servers: resets count per target (an API
server answers for all its engines at once), and the KV-events publishers are not known here
(vLLM's API server does not put them on the routes this mode reads), so ``/kv_events_targets``
is an empty list and ``/status`` says ``null``."""

from __future__ import annotations

from exporter.sim.options import SimOptions
from tests.harness.apiservers import StartApi, http_config
from tests.harness.scrape import metric_value
from tests.harness.service import ServiceFactory
from tests.harness.statusschema import validate_status

COUNTER = "vllm_dp_prefix_cache_confirmed_resets_total"


async def test_resets_count_per_target_and_no_publisher_is_known(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    ok = await start_api(engines=2)
    refusing = await start_api(
        engines=2, engine_options=[SimOptions(), SimOptions(refuse_reset=True)]
    )
    older = await start_api(engines=1, vllm_version="0.31.0")
    config = http_config([f"ok={ok.url}", f"refusing={refusing.url}", f"older={older.url}"])
    svc = await start_exporter(config)
    await svc.fresh_poll()  # every target's /version read

    status, body, _ = await svc.reset()
    assert status == 502, body
    m = await svc.scrape()
    assert {t: metric_value(m, COUNTER, engine=t) for t in ("ok", "refusing", "older")} == {
        "ok": 1.0,
        "refusing": 0.0,  # one of its engines refused: the server answers failure
        "older": 1.0,  # the reset's own answer counts on any version
    }
    assert svc.admin_url is not None
    async with svc.session.post(svc.admin_url + "/admin/pause") as resp:
        assert resp.status == 200, await resp.text()
    doc = await svc.status()
    validate_status(doc)
    by_target = {e["engine"]: e for e in doc["engines"]}
    assert {t: e["prefix_cache"]["confirmed_resets"] for t, e in by_target.items()} == {
        "ok": 2,
        "refusing": 1,  # vLLM 0.33's /pause clears the cache on every engine behind it
        "older": 1,  # 0.31's pause is not one read for this: not assumed
    }
    assert by_target["ok"]["prefix_cache"]["last_reset_action"] == "pause"
    assert all(e["kv_events"] is None for e in doc["engines"])
    assert await svc.get_json("/kv_events_targets") == (200, [])
