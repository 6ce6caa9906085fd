"""The exporter end to end over real sockets — simulated engines speak ZMQ to the
exporter, the tests scrape its real HTTP server and parse with prometheus_client's parser."""

from __future__ import annotations

import gzip

from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS
from tests.harness.scrape import metric_value as value
from tests.harness.scrape import samples
from tests.harness.service import CALL_TIMEOUT, ServiceFactory

ENGINE_STATES = ("awake", "asleep", "paused", "stalled", "hung", "unknown")


async def test_per_engine_gauges_and_consistent_aggregate(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, options=SimOptions(vllm_version="0.99.1"))
    m = await fleet.scrape()
    for engine in ("0", "1", "2"):
        assert value(m, "vllm_dp_engine_up", engine=engine) == 1.0
        assert value(m, "vllm_dp_engine_sleeping", engine=engine) == 0.0
        assert value(m, "vllm_dp_engine_paused", engine=engine) == 0.0
        states = {
            s.labels["state"]: s.value for s in samples(m, "vllm_dp_engine_state", engine=engine)
        }
        assert states == {
            "awake": 1.0,
            "asleep": 0.0,
            "paused": 0.0,
            "stalled": 0.0,
            "hung": 0.0,
            "unknown": 0.0,
        }
        info = samples(m, "vllm_dp_engine_info", engine=engine)
        assert [
            (s.labels["vllm_version"], s.labels["enable_sleep_mode"], s.value) for s in info
        ] == [("0.99.1", "true", 1.0)]
        assert value(m, "vllm_dp_engine_last_success_timestamp_seconds", engine=engine)
    assert value(m, "vllm_dp_sleeping") == 0.0
    assert value(m, "vllm_dp_sleep_state_consistent") == 1.0
    assert value(m, "vllm_dp_fleet_state", state="consistent") == 1.0
    assert value(m, "vllm_dp_fleet_state", state="inconsistent") == 0.0
    assert value(m, "vllm_dp_fleet_state", state="unknown") == 0.0
    assert value(m, "vllm_dp_engines_expected") == 3.0
    assert value(m, "vllm_dp_engines_connected") == 3.0
    assert value(m, "vllm_dp_utility_calls", method="is_sleeping", engine="0", outcome="ok")


async def test_whole_fleet_asleep_and_paused_states(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2)
    for engine in fleet.engines:
        engine.state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    m = await fleet.scrape()
    assert value(m, "vllm_dp_sleeping") == 1.0
    assert value(m, "vllm_dp_sleep_state_consistent") == 1.0
    assert value(m, "vllm_dp_engine_state", engine="0", state="asleep") == 1.0
    assert value(m, "vllm_dp_engine_paused", engine="0") == 0.0

    for engine in fleet.engines:
        engine.state.sleeping_tags = set()
        engine.state.paused = True
    await fleet.next_polls()
    m = await fleet.scrape()
    # vLLM's is_sleeping is also true while the scheduler is merely paused.
    assert value(m, "vllm_dp_engine_sleeping", engine="1") == 1.0
    assert value(m, "vllm_dp_engine_paused", engine="1") == 1.0
    assert value(m, "vllm_dp_engine_state", engine="1", state="paused") == 1.0
    assert value(m, "vllm_dp_engine_state", engine="1", state="asleep") == 0.0


async def test_inconsistency_counter_counts_polls_not_scrapes(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(2, poll_interval=0.4, poll_jitter=0)
    method = {"method": "is_sleeping"}
    fleet.engines[0].state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    m = await fleet.scrape()
    assert value(m, "vllm_dp_sleep_state_consistent") == 0.0
    assert value(m, "vllm_dp_sleeping") is None  # absent while inconsistent
    assert value(m, "vllm_dp_fleet_state", state="inconsistent") == 1.0
    assert value(m, "vllm_dp_engine_sleeping", engine="0") == 1.0
    assert value(m, "vllm_dp_engine_sleeping", engine="1") == 0.0
    start_count = value(m, "vllm_dp_inconsistent_utility_results", **method)
    assert start_count is not None and start_count >= 1
    start_polls = value(m, "vllm_dp_polls")
    assert start_polls is not None

    # Several scrapes between two polls: the counter stays put.
    await fleet.exporter.poller.wait_for_poll(fleet.exporter.poller.snapshot.poll_number, 5)
    seen = []
    for _ in range(5):
        m = await fleet.scrape()
        seen.append(
            (value(m, "vllm_dp_polls"), value(m, "vllm_dp_inconsistent_utility_results", **method))
        )
    polls_seen = {p for p, _ in seen}
    assert len(polls_seen) < len(seen), "no two scrapes fell between the same two polls"
    for polls, count in seen:
        assert polls is not None and count is not None
        # While the engines disagree, every poll (and only a poll) adds exactly one.
        assert count - start_count == polls - start_polls

    # Agreement again: polls go on, the counter stops.
    fleet.engines[0].state.sleeping_tags = set()
    await fleet.next_polls()
    m = await fleet.scrape()
    stopped_at = value(m, "vllm_dp_inconsistent_utility_results", **method)
    polls_then = value(m, "vllm_dp_polls")
    await fleet.next_polls(3)
    m = await fleet.scrape()
    assert value(m, "vllm_dp_polls") >= polls_then + 3  # type: ignore[operator]
    assert value(m, "vllm_dp_inconsistent_utility_results", **method) == stopped_at
    assert value(m, "vllm_dp_sleep_state_consistent") == 1.0


async def test_a_silent_engine_is_unknown_not_inconsistent(fleet_factory: ServiceFactory) -> None:
    """An engine that stops answering reads unknown until --hung-after passes (then hung:
    tests/integration/service/test_service_activity.py); never inconsistent."""
    fleet = await fleet_factory(3, hung_after=60.0)
    fleet.engines[2].options.hang = True
    await fleet.next_polls()
    m = await fleet.scrape()
    assert value(m, "vllm_dp_engine_up", engine="2") == 0.0
    assert value(m, "vllm_dp_engine_sleeping", engine="2") is None
    assert value(m, "vllm_dp_engine_paused", engine="2") is None
    assert value(m, "vllm_dp_engine_state", engine="2", state="unknown") == 1.0
    timeouts = value(
        m, "vllm_dp_utility_calls", method="is_sleeping", engine="2", outcome="timeout"
    )
    assert timeouts is not None and timeouts >= 1
    assert value(m, "vllm_dp_engine_up", engine="0") == 1.0
    assert value(m, "vllm_dp_engine_sleeping", engine="0") == 0.0
    # The others agree: the aggregate is unknown, neither a value nor "inconsistent".
    assert value(m, "vllm_dp_sleeping") is None
    assert value(m, "vllm_dp_sleep_state_consistent") is None
    assert value(m, "vllm_dp_fleet_state", state="unknown") == 1.0
    assert value(m, "vllm_dp_fleet_state", state="inconsistent") == 0.0

    status, body = await fleet.get_json("/status")
    assert status == 200
    hung = body["engines"][2]
    answer = hung["invariants"]["is_sleeping"]
    assert answer["outcome"] == "timeout" and answer["value"] is None and hung["up"] is False
    assert str(CALL_TIMEOUT) in answer["error"]
    assert body["aggregate"]["is_sleeping"]["missing"] == ["2"]
    assert body["aggregate"]["is_sleeping"]["consistent"] is None
    status, _ = await fleet.get_json("/readyz")
    assert status == 503


async def test_readyz_goes_from_503_to_200(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, start=False)
    status, body = await fleet.get_json("/readyz")
    assert status == 503
    assert body["ready"] is False and body["engines_expected"] == 2
    assert (await fleet.get_json("/healthz"))[0] == 200
    m = await fleet.scrape()
    assert value(m, "vllm_dp_engines_connected") == 0.0
    assert value(m, "vllm_dp_fleet_state", state="unknown") == 1.0

    await fleet.start_engines()
    await fleet.ready()
    status, body = await fleet.get_json("/readyz")
    assert status == 200
    assert body == {
        "ready": True,
        "engines_expected": 2,
        "engines_connected": 2,
        "last_poll": body["last_poll"],
    }
    assert body["last_poll"] >= 1


async def test_status_json_shape(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, model_name="m-7b", options=SimOptions(vllm_version="0.33.0"))
    status, body = await fleet.get_json("/status")
    assert status == 200
    assert body["ready"] is True
    assert body["attach"] == "owner" and body["model_name"] == "m-7b"
    assert body["engines_expected"] == 2 and body["engines_connected"] == 2
    agg = body["aggregate"]["is_sleeping"]
    assert agg["state"] == "consistent" and agg["value"] is False and agg["consistent"] is True
    assert body["last_poll"]["number"] >= 1 and body["last_poll"]["unix"] > 0
    assert [e["engine"] for e in body["engines"]] == ["0", "1"]
    for e in body["engines"]:
        assert e["invariants"]["is_sleeping"]["outcome"] == "ok"
        assert e["invariants"]["is_sleeping"]["value"] is False
        assert e["up"] is True and e["connected"] is True
        assert e["state"] == "awake"
        assert isinstance(e["last_success_unix"], float) and e["last_success_unix"] > 0
        assert e["vllm_version"] == "0.33.0"
        assert e["enable_sleep_mode"] is True
        assert e["invariants"]["is_sleeping"]["error"] is None

    fleet.engines[1].state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    _, body = await fleet.get_json("/status")
    agg = body["aggregate"]["is_sleeping"]
    assert agg["state"] == "inconsistent" and agg["consistent"] is False
    assert agg["value"] is None and agg["values"] == [False, True]
    assert "is_sleeping" in agg["error"]
    assert [e["invariants"]["is_sleeping"]["value"] for e in body["engines"]] == [False, True]


async def test_openmetrics_negotiation(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1)
    accept = "application/openmetrics-text; version=1.0.0"
    async with fleet.session.get(fleet.url + "/metrics", headers={"Accept": accept}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert "version=1.0.0" in resp.headers["Content-Type"]
        text = await resp.text()
    assert text.rstrip("\n").endswith("# EOF")
    assert "vllm_dp_engine_up" in text
    async with fleet.session.get(fleet.url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        assert "# EOF" not in await resp.text()


async def test_gzip_on_request(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(1)
    async with fleet.session.get(
        fleet.url + "/metrics", headers={"Accept-Encoding": "gzip"}, auto_decompress=False
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Encoding"] == "gzip"
        raw = await resp.read()
    assert b"vllm_dp_engine_up" in gzip.decompress(raw)
    async with fleet.session.get(
        fleet.url + "/metrics", headers={"Accept-Encoding": "identity"}, auto_decompress=False
    ) as resp:
        assert "Content-Encoding" not in resp.headers
        assert b"vllm_dp_engine_up" in await resp.read()


async def test_html_page_lists_every_engine(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, model_name="llama<3>")
    async with fleet.session.get(fleet.url + "/") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        page = await resp.text()
    for engine in ("0", "1", "2"):
        row = f'<tr data-engine="{engine}" data-up="true"><td>{engine}</td><td class="up">up</td>'
        assert row + "<td>awake</td>" in page
    assert "llama&lt;3&gt;" in page and "llama<3>" not in page
    assert 'id="v-is_sleeping" data-state="consistent"' in page
    assert 'CONSISTENT</strong> <span class="detail">false (awake)</span>' in page
    assert "connected 3/3" in page


async def test_model_name_labels_every_series(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(2, model_name="qwen-72b")
    status, _, _ = await fleet.reset()
    assert status == 200
    m = await fleet.scrape()
    all_samples = [s for f in m.values() if f.name.startswith("vllm_dp_") for s in f.samples]
    assert len(all_samples) > 30
    for s in all_samples:
        assert s.labels.get("model_name") == "qwen-72b", s

    plain = await fleet_factory(1)
    m = await plain.scrape()
    assert all("model_name" not in s.labels for f in m.values() for s in f.samples)
