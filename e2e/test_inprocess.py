"""In-process mode against real vLLM 0.32 (docs/e2e.md, "In-process mode", scenario 8).

The checkout is installed into vLLM's environment first (``e2e.plugin_install``). Three
deployments, one per test class, each started once and stopped when its class ends:

* 8a ``TestPluginInVllmServe``: ``vllm serve --data-parallel-size 2`` (internal load balancing,
  ``--api-server-count`` left to vLLM: 2 API servers) with ``VLLM_PLUGINS=dp_exporter``: the
  per-engine series on vLLM's own ``/metrics``, ``/dp/status``, completions while both API
  servers' exporters poll every second, a reset refused by the one engine holding a long
  generation, weight version, pause and resume through ``/dp/admin/*``, the token, OpenAPI;
* 8b ``TestPluginNotAllowListed``: the package installed and configured but ``VLLM_PLUGINS``
  unset (one engine): vLLM starts as always and loads nothing of it; plus vLLM's allow-list
  rule itself for unset, empty, other and listed values (no server);
* 8c ``TestEmbeddedTrainer``: ``e2e/embedded_trainer.py``, a process owning an ``AsyncLLM`` with
  2 DP engines and running ``exporter.inprocess.start_exporter`` over it; SIGTERM stops it cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from e2e import plugin_install, web
from e2e.activity import (
    ActivityLog,
    activities,
    generation_is_work_then_drains,
    pause_wait_during_generation,
)
from e2e.inprocess import (
    NOT_ALLOWED_WARNING,
    Endpoint,
    PluginServer,
    Trainer,
    every_api_server,
    group_alive,
    start_plugin_server,
    start_trainer,
    start_unlisted_server,
    wait_every_api_server,
    write_token,
)
from e2e.procs import ProcessGroup, first_exited
from e2e.traffic import (
    LongGeneration,
    complete,
    front_end_generated,
    paused_keeping_requests,
    start_long_generations,
)
from e2e.vllm_features import ENDPOINT_PLUGIN_OVERRIDES, ENDPOINT_PLUGINS, VllmFeatures
from e2e.vllm_runtime import VllmRuntime, engine_core_pids

pytestmark = pytest.mark.timeout(900)

ENGINES = ("0", "1")
PROMPT = "w1 w2 w3 w4"
#: Every utility call the exporter sent, by method, engine and outcome.
CALLS = "vllm_dp_utility_calls_total"
# As long as the context allows (4096): the longer it runs, the less the pause can come late.
LONG_TOKENS = 4000
# A reset both engines accepted means the generation had ended before the pause: retried once.
RESET_ATTEMPTS = 2
SCRAPES = 20
COMPLETIONS = 20
POLL_WAIT_S = 15.0
# GET /dp/gate answers from a fan-out at most 0.2 s old (the default gate_min_interval).
GATE_MIN_INTERVAL_S = 0.2
STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def plugin_runtime(runtime: VllmRuntime) -> VllmRuntime:
    """vLLM's environment with this checkout installed in it (re-installed when changed)."""
    result = plugin_install.install(runtime.version)
    assert result.venv == runtime.venv
    return runtime


@pytest.fixture(scope="module")
def token(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return write_token(tmp_path_factory.mktemp("inprocess-token"))


# -- helpers -------------------------------------------------------------------------------------


def reasons(body: dict[str, Any]) -> list[tuple[str, bool, str | None]]:
    return [(str(e["engine"]), e["ok"], e["reason"]) for e in body["engines"]]


def engine_results(body: dict[str, Any]) -> list[tuple[str, bool, str | None, Any]]:
    """(engine, ok, reason, state read back) of an admin action's answer."""
    return [(str(e["engine"]), e["ok"], e["reason"], e.get("state")) for e in body["engines"]]


def confirmed(reply: web.Reply, action: str, *, verified: bool) -> dict[str, Any]:
    body: dict[str, Any] = reply.json()
    assert reply.status == 200, body
    assert body["action"] == action and body["outcome"] == "success", body
    assert body["failed_engines"] == [] and body["verified"] is verified, body
    return body


def gate(endpoint: Endpoint, expect: int, **conditions: str) -> dict[str, Any]:
    reply = endpoint.gate(**conditions)
    body: dict[str, Any] = reply.json()
    assert reply.status == expect, (conditions, body)
    return body


def after_action() -> None:
    """Let the gate's shared fan-out expire (it may predate the action, docs/e2e.md)."""
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)


def per_engine(status: dict[str, Any], method: str) -> list[tuple[str, str, Any]]:
    """(engine, outcome, value) of one polled invariant, per engine."""
    return [
        (str(e["engine"]), e["invariants"][method]["outcome"], e["invariants"][method]["value"])
        for e in status["engines"]
    ]


def wait_status(
    endpoint: Endpoint,
    method: str,
    value: Any,
    state: str | None = None,
    timeout_s: float = POLL_WAIT_S,
) -> dict[str, Any]:
    """/status once every engine's polled ``method`` is ``value`` (and its ``state`` is
    ``state``, when given). With several API servers each answer comes from whichever one
    accepted the connection, and each polls for itself: one answer says nothing of the
    other's, so every condition is checked on one and the same document."""
    wanted = [(e, "ok", value) for e in ENGINES]

    def probe() -> dict[str, Any] | None:
        status = endpoint.status()
        if per_engine(status, method) != wanted:
            return None
        if state is not None and [e["state"] for e in status["engines"]] != [state] * 2:
            return None
        return status

    return web.wait_for(probe, timeout_s, f"{method} {value!r} on every engine")


def wait_both_servers(endpoint: Endpoint, method: str, value: Any, state: str | None) -> None:
    """``wait_status`` a few times in a row: both API servers answer some of them."""
    for _ in range(4):
        wait_status(endpoint, method, value, state)


def assert_engine_series(scrape: web.Scrape) -> None:
    """``vllm_dp_engine_up`` exactly once per engine and no other engine (1 = answering)."""
    ups = sorted((s.labels.get("engine"), s.value) for s in scrape.find("vllm_dp_engine_up"))
    assert ups == [(e, 1.0) for e in ENGINES], ups


def assert_families_once(text: str) -> None:
    """Every family is declared once: vLLM's body and the merged vllm_dp_* families side by
    side must not repeat a name (Prometheus would reject the scrape)."""
    declared = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    repeated = sorted({n for n in declared if declared.count(n) > 1})
    assert not repeated, repeated


def reset_while_generating(served: PluginServer) -> tuple[web.Reply, LongGeneration]:
    """One long streamed generation (vLLM's load balancer puts it on one engine), vLLM paused
    with ``mode=keep&clear_cache=false`` so the running request keeps its KV blocks however
    fast this CPU generates (e2e/test_relay.py, scenario 4), the plugin's reset, resume."""
    (gen,) = start_long_generations(served.api_url, 1, LONG_TOKENS)
    with paused_keeping_requests(served.api_url, served.endpoint.status):
        reply = served.endpoint.reset()
        assert not gen.finished.is_set(), "the generation ended before the reset"
    return reply, gen


# -- 8b: vLLM's allow-list rule (no server) -----------------------------------------------------

# Run in vLLM's Python: which endpoint plugins vLLM's own loader returns for each VLLM_PLUGINS.
ALLOW_LIST_PROBE = """
import json, os, sys
from vllm.plugins import load_endpoint_plugins
answers = {}
for value in json.loads(sys.argv[1]):
    os.environ.pop("VLLM_PLUGINS", None)
    if value is not None:
        os.environ["VLLM_PLUGINS"] = value
    answers[str(value)] = sorted(p.name for p in load_endpoint_plugins(("generate",)))
print(json.dumps(answers))
"""


@pytest.mark.vllm_needs(ENDPOINT_PLUGINS)
def test_scenario8b_vllm_loads_the_plugin_only_when_allow_listed(
    plugin_runtime: VllmRuntime, tmp_path: Path
) -> None:
    """vLLM 0.32's ``load_endpoint_plugins``: unset loads no endpoint plugin at all (unlike
    the other plugin groups, where unset means every one) and warns that one is installed;
    an empty value or another name loads none; a list naming ``dp_exporter`` loads it."""
    values = [None, "", "some_other_plugin", "some_other_plugin,dp_exporter", "dp_exporter"]
    out = subprocess.run(
        [str(plugin_runtime.venv / "bin" / "python"), "-I", "-c", ALLOW_LIST_PROBE,
         json.dumps(values)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
        env=plugin_runtime.env(),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {
        "None": [],
        "": [],
        "some_other_plugin": [],
        "some_other_plugin,dp_exporter": ["dp_exporter"],
        "dp_exporter": ["dp_exporter"],
    }
    assert NOT_ALLOWED_WARNING in out.stdout + out.stderr


# -- 8a: the plugin in vllm serve with 2 DP engines and 2 API servers ---------------------------


@pytest.fixture(scope="class")
def served(
    plugin_runtime: VllmRuntime, class_procs: ProcessGroup, token: tuple[Path, str]
) -> PluginServer:
    return start_plugin_server(plugin_runtime, class_procs, *token)


# The plugin's GET /metrics replaces vLLM's own (vLLM 0.32; before, vLLM's route came first).
@pytest.mark.vllm_needs(
    ENDPOINT_PLUGINS, ENDPOINT_PLUGIN_OVERRIDES, "get_weight_version", "GET /weight_info"
)
class TestPluginInVllmServe:
    def test_scenario8a_two_api_servers_each_polling_both_engines(
        self, served: PluginServer
    ) -> None:
        """What vLLM started: 2 API servers (its default under internal LB), the plugin loaded
        in each, each polling both engines through its own engine-core client."""
        log = served.server.log_text()
        assert "Defaulting api_server_count to data_parallel_size (2)" in log
        for index in (0, 1):
            assert f"(ApiServer_{index} pid=" in log
        assert log.count("Loaded endpoint plugin dp_exporter") == 2
        assert log.count("Endpoint plugin overrides GET /metrics") == 2
        for index in (0, 1):  # the plugin's own start line, in each API server
            assert f"polling of 2 engines every 1s in API server {index} of 2" in log
        # Each /dp/status comes from whichever API server accepted the connection; the
        # fixture waited for both to be ready (e2e.inprocess.wait_every_api_server).
        clients = wait_every_api_server(served.endpoint, 2, served.server)
        assert clients == {"in-process (vLLM client 0)", "in-process (vLLM client 1)"}
        # One reader per deployment: API server 0 asks the engines, API server 1 follows its
        # published reading (docs/inprocess.md, "Several API server processes").
        sources: dict[str, dict[str, Any]] = {}

        def both_sources_seen() -> bool:
            status = served.endpoint.status()
            address = status["engines"][0]["address"]
            sources[address] = status["last_poll"]["source"]
            follower = sources.get("in-process (vLLM client 1)")
            return len(sources) == 2 and follower is not None and follower["from"] != "self"

        web.wait_for(both_sources_seen, 60, "both API servers' poll sources", interval_s=0.1)
        assert sources["in-process (vLLM client 0)"]["role"] == "leader", sources
        follower = sources["in-process (vLLM client 1)"]
        assert follower["role"] == "follower" and follower["from"] == "api_server_0", sources
        status = served.endpoint.status()
        assert status["attach"] == "inprocess" and status["engines_connected"] == 2
        assert [e["engine"] for e in status["engines"]] == list(ENGINES)

    def test_scenario8a_engine_series_on_vllms_own_metrics(self, served: PluginServer) -> None:
        for _ in range(SCRAPES):
            scrape = served.endpoint.scrape()
            assert_engine_series(scrape)
            # vLLM's own series are still there, first. (With several API servers vLLM
            # disables its stats logging: its engine gauges are declared but have no sample.)
            assert "# TYPE vllm:num_requests_running gauge" in scrape.text
            assert scrape.find("vllm:generation_tokens_total"), "vLLM's own series are missing"
            assert scrape.text.index("vllm:") < scrape.text.index("vllm_dp_engine_up")
            for engine in ENGINES:
                assert scrape.value("vllm_dp_engine_paused", engine=engine) == 0
                assert scrape.value("vllm_dp_engine_state", engine=engine, state="awake") == 1
                assert scrape.value("vllm_dp_engine_info", engine=engine) is not None
            assert scrape.value("vllm_dp_engines_connected") == 2
            time.sleep(0.1)

    def test_scenario8a_each_family_declared_once(self, served: PluginServer) -> None:
        assert_families_once(served.endpoint.scrape().text)

    def test_scenario8a_status_per_engine_and_the_other_routes(
        self, served: PluginServer, vllm_features: VllmFeatures
    ) -> None:
        endpoint, url = served.endpoint, served.api_url
        status = endpoint.status()
        assert status["ready"] is True and status["engines_expected"] == 2
        for method in ("is_sleeping", "is_scheduler_paused"):
            assert per_engine(status, method) == [(e, "ok", False) for e in ENGINES]
            assert status["aggregate"][method]["state"] == "consistent"
        for engine in status["engines"]:
            assert engine["up"] is True and engine["state"] == "awake", engine
            assert engine["vllm_version"] == "0.32.0", engine
            # Only what this vLLM lacks (checkpoint_state before 0.34) reads unsupported.
            assert set(engine["unsupported"]) <= set(vllm_features.lacks()), engine
        assert web.get(f"{url}/dp/readyz").json()["engines_connected"] == 2
        page = web.get(f"{url}/dp/")
        assert page.status == 200 and b"<html" in page.body.lower()
        openapi = web.get(f"{url}/openapi.json").json()
        assert "/dp/status" in openapi["paths"]
        assert "/dp/admin/reset_prefix_cache" in openapi["paths"]
        assert "/v1/completions" in openapi["paths"]  # vLLM's own routes stay

    def test_scenario8a_admin_refused_without_the_token(self, served: PluginServer) -> None:
        for token in (None, "not-the-token"):
            reply = served.endpoint.admin("reset_prefix_cache", token=token)
            assert reply.status == 401, reply
        assert web.get(f"{served.api_url}/dp/admin/reset_prefix_cache").status == 405

    def test_scenario8a_completions_while_the_plugin_polls_every_second(
        self, served: PluginServer
    ) -> None:
        endpoint, api = served.endpoint, served.api_url
        before = complete(api, PROMPT, 16)
        polls_before = endpoint.status()["last_poll"]["number"]
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(complete, api, f"{PROMPT} w{i}", 64) for i in range(COMPLETIONS)]
            done = [f.result(timeout=300) for f in futures]
        elapsed = time.monotonic() - started
        assert [c["usage"]["completion_tokens"] for c in done] == [64] * COMPLETIONS
        after = complete(api, PROMPT, 16)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        status = endpoint.status()
        # Polled all along (each API server every second; the answer is from either one).
        assert status["last_poll"]["number"] >= polls_before + int(elapsed) - 2, (
            status["last_poll"],
            polls_before,
            elapsed,
        )
        assert status["counters"]["failed_calls_total"] == 0
        assert status["aggregate"]["is_sleeping"]["state"] == "consistent"

    def test_scenario8a_reset_refused_by_the_engine_holding_a_long_generation(
        self, served: PluginServer
    ) -> None:
        endpoint = served.endpoint
        for attempt in range(1, RESET_ATTEMPTS + 1):
            refused, gen = reset_while_generating(served)
            body = refused.json()
            if refused.status != 200 or attempt == RESET_ATTEMPTS:
                break
            # Both engines accepted: the generation had ended on its engine before the pause
            # took hold (the client was still reading its buffered tokens), so no request held
            # blocks. Not what this test is about: once more, after it ends.
            assert reasons(body) == [(e, True, None) for e in ENGINES], body
            gen.result(600)
        assert refused.status == 502, body
        assert body["outcome"] == "partial_failure", body
        # vLLM's internal load balancer chose the engine: the answer says which.
        refusing = [e for e, ok, _ in reasons(body) if not ok]
        assert len(refusing) == 1, body
        busy = refusing[0]
        assert reasons(body) == [(e, e != busy, None if e != busy else "refused") for e in ENGINES]
        assert body["failed_engines"] == [int(busy)]
        # Counted once over both API servers' exporters (counters are summed across them,
        # each process publishes its own within a second).
        web.wait_for(
            lambda: (
                endpoint.scrape().value(
                    "vllm_dp_prefix_cache_reset_engine_failures_total",
                    engine=busy,
                    reason="refused",
                )
                == 1
            ),
            POLL_WAIT_S,
            f"the refusal of engine {busy} counted once",
        )
        assert gen.result(600) == LONG_TOKENS
        reply = endpoint.reset()
        assert reply.status == 200, reply.body
        assert reasons(reply.json()) == [(e, True, None) for e in ENGINES]

    def test_scenario8a_weight_version_through_the_plugin(self, served: PluginServer) -> None:
        endpoint = served.endpoint
        body = gate(endpoint, 412, weight_version="rl-7")
        assert body["failing_engines"] == list(ENGINES)
        body = confirmed(
            endpoint.admin("weight_version", {"weight_version": "rl-7"}),
            "weight_version",
            verified=True,
        )
        assert engine_results(body) == [(e, True, None, "rl-7") for e in ENGINES]
        after_action()
        gate(endpoint, 200, weight_version="rl-7")
        # Both API servers' polls see it (each answers some of these /dp/status calls).
        wait_both_servers(endpoint, "get_weight_version", "rl-7", None)
        assert web.get(f"{served.api_url}/weight_info").json() == {"weight_version": "rl-7"}
        # The gauges of /metrics are API server 0's, read from its file when the other one
        # answers: up to a second behind its own /dp/status.
        web.wait_for(
            lambda: all(
                endpoint.scrape().value(
                    "vllm_dp_engine_weight_version_info", engine=e, weight_version="rl-7"
                )
                == 1
                for e in ENGINES
            ),
            POLL_WAIT_S,
            "vllm_dp_engine_weight_version_info rl-7 for both engines",
        )

    def test_scenario8a_pause_and_resume_through_the_plugin(self, served: PluginServer) -> None:
        endpoint = served.endpoint
        body = confirmed(endpoint.admin("pause"), "pause", verified=True)
        assert engine_results(body) == [(e, True, None, True) for e in ENGINES]
        try:
            after_action()
            gate(endpoint, 200, paused="true")
            body = gate(endpoint, 412, paused="false")
            assert body["failing_engines"] == list(ENGINES)
            wait_both_servers(endpoint, "is_scheduler_paused", True, "paused")
            web.wait_for(
                lambda: all(
                    endpoint.scrape().value("vllm_dp_engine_paused", engine=e) == 1 for e in ENGINES
                ),
                POLL_WAIT_S,
                "vllm_dp_engine_paused 1 for both engines",
            )
        finally:
            resumed = endpoint.admin("resume")
        body = confirmed(resumed, "resume", verified=True)
        assert engine_results(body) == [(e, True, None, False) for e in ENGINES]
        after_action()
        gate(endpoint, 200, paused="false", sleeping="false", weight_version="rl-7")
        wait_both_servers(endpoint, "is_scheduler_paused", False, "awake")
        assert complete(served.api_url, PROMPT, 8)["usage"]["completion_tokens"] == 8

    def test_scenario11_a_stopped_engine_is_hung_in_each_api_server_then_routable(
        self, served: PluginServer
    ) -> None:
        """SIGSTOP on rank 1's engine process: each API server's plugin reads it ``hung``
        (connected: vLLM's client has not marked it dead) and leaves it out of /dp/routable and
        /dp/readyz?engine=1, rank 0 routable; SIGCONT: routable again in both servers.

        Each server polls and times its silence for itself, so one reads ``hung`` up to a poll
        before the other: the routes are read once every server's own ``/dp/status`` said so
        (a request reaches whichever server accepts it first)."""
        endpoint = served.endpoint
        pid = engine_core_pids(served.server)[1]

        def exited() -> str | None:
            return first_exited(served.server)

        def rank1_hung(doc: dict[str, Any]) -> bool:
            ranks = {str(e["engine"]): e for e in doc["engines"]}
            reasons = ranks["1"]["routable"]["reasons"]
            return (
                ranks["1"]["state"] == "hung"
                and any(r.startswith("hung:") for r in reasons)
                and ranks["0"]["routable"]["routable"] is True
            )

        os.kill(pid, signal.SIGSTOP)
        try:
            every_api_server(endpoint, 2, rank1_hung, "rank 1 hung", 90, abort=exited)
            for _ in range(4):  # both servers answer some of these: each now reads it hung
                doc: dict[str, Any] = web.get(f"{endpoint.url}/dp/routable").json()
                reasons = {e["engine"]: e["reasons"] for e in doc["engines"]}
                assert doc["routable_engines"] == ["0"], doc
                assert any(r.startswith("hung:") for r in reasons["1"]), doc
                assert web.get(f"{endpoint.url}/dp/readyz?engine=1").status == 503
        finally:
            os.kill(pid, signal.SIGCONT)
        every_api_server(
            endpoint,
            2,
            lambda doc: all(e["routable"]["routable"] for e in doc["engines"]),
            "rank 1 routable again",
            90,
            abort=exited,
        )
        for _ in range(4):
            assert web.get(f"{endpoint.url}/dp/readyz?engine=1").status == 200
        assert complete(served.api_url, PROMPT, 8)["usage"]["completion_tokens"] == 8

    @pytest.mark.vllm_needs("has_work")
    def test_scenario12a_a_generation_is_work_on_its_rank_the_other_is_drained(
        self, served: PluginServer
    ) -> None:
        """One long streamed generation pinned to a rank (``X-data-parallel-rank``): that rank has
        work in /dp/status (``running`` ≥ 1, from the front end's load-balancing table) and
        ``vllm_dp_engine_has_work`` 1 on vLLM's /metrics, the other is drained (0 and 0);
        ``/dp/gate?drained=true`` 412 naming that rank alone with its counts; 200 again within
        60 s of the stream's end (e2e/activity.py)."""
        endpoint = served.endpoint

        def busy_rank() -> str | None:
            acts = activities(endpoint.status())
            running = [e for e, a in acts.items() if a["has_work"] and (a["running"] or 0) >= 1]
            return running[0] if len(running) == 1 else None

        with ActivityLog(endpoint.status) as log:
            seen = generation_is_work_then_drains(
                endpoint, served.api_url, busy_rank, counts_known=True, log=log
            )
        print(
            f"scenario 12a (in-process): rank {seen.busy} busy, seen "
            f"+{seen.seen_after_s:.1f}s after the request; {seen.generation.timeline(log.since)}"
            f"; gate 200 {seen.drained_after_s:.2f}s after the stream ended; "
            f"timeline: {log.timeline()}"
        )

    def test_scenario13a_progress_from_vllms_stat_loggers_grows_on_the_generating_rank(
        self, served: PluginServer
    ) -> None:
        """vLLM loads the package's stat-logger plugin beside the endpoint plugin: after a
        completion, the rank whose own ``vllm:generation_tokens_total`` grew shows that many
        more computed tokens on ``vllm_dp_engine_progress_tokens_total``, the other rank none;
        every rank's ``/dp/status`` progress comes from the stat logger and none is stalled.
        Two API servers here: each counts its own requests' tokens (``/dp/status`` is the
        answering one's view), the series sum both (the share, about a second behind), so
        the counts compared are the series'."""
        endpoint, url = served.endpoint, served.api_url
        doc = endpoint.status()
        assert all(e["progress"]["source"] == "stat_logger" for e in doc["engines"]), doc
        assert all(e["state"] != "stalled" for e in doc["engines"]), doc["engines"]

        def summed() -> dict[str, float]:
            scrape = endpoint.scrape()
            return {
                e: scrape.value("vllm_dp_engine_progress_tokens_total", engine=e) or 0.0
                for e in ENGINES
            }

        def steady() -> dict[str, float] | None:  # earlier scenarios' tokens all shared
            # Longer than a poll (1 s) plus the share's lag (about a second): a count still on
            # its way from either API server shows up inside the window.
            first = summed()
            time.sleep(3.0)
            return first if summed() == first else None

        before = web.wait_for(steady, 30, "the progress series steady")
        generated = front_end_generated(url)
        assert complete(url, PROMPT, 32)["usage"]["completion_tokens"] == 32
        grew = {e: n - generated.get(e, 0.0) for e, n in front_end_generated(url).items()}
        busy = [e for e, n in grew.items() if n >= 32]
        assert len(busy) == 1, grew  # one rank generated it

        def moved() -> dict[str, float] | None:
            now = summed()
            return now if now[busy[0]] >= before[busy[0]] + 32 else None

        after = web.wait_for(moved, 20, "the generating rank's progress series")
        assert all(after[e] == before[e] for e in ENGINES if e != busy[0]), (before, after)
        print(f"scenario 13a (in-process): rank {busy[0]} {before} -> {after}, vLLM's {grew}")

    @pytest.mark.vllm_needs("has_work")
    def test_scenario13c_a_listening_poll_asks_no_engine_has_work_in_steady_state(
        self, served: PluginServer
    ) -> None:
        """vLLM's front end follows the DP coordinator's counts and its own unfinished requests:
        every rank's activity is told by them (``has_work_read: told`` in ``/dp/status``),
        and over several polls ``vllm_dp_utility_calls_total{method="has_work"}`` does not
        grow while ``is_sleeping``'s does (docs/activity.md, a listening poll); a completion
        meanwhile changes nothing of it. The gate still asks every rank."""
        endpoint, url = served.endpoint, served.api_url

        def told() -> dict[str, Any] | None:
            doc = endpoint.status()
            froms = [e["activity"]["has_work_read"] for e in doc["engines"]]
            return doc if froms == ["told"] * len(ENGINES) else None

        web.wait_for(told, 30, "every rank's has_work told by its counts")
        first = endpoint.scrape()
        assert complete(url, PROMPT, 16)["usage"]["completion_tokens"] == 16
        time.sleep(4.0)  # four polls of 1 s
        then = endpoint.scrape()
        asked = {
            m: then.total(CALLS, method=m) - first.total(CALLS, method=m)
            for m in ("has_work", "is_sleeping")
        }
        assert asked["has_work"] == 0 and asked["is_sleeping"] >= 2 * len(ENGINES), asked
        assert told() is not None, endpoint.status()
        time.sleep(GATE_MIN_INTERVAL_S + 0.1)
        assert endpoint.gate(drained="true").status in (200, 412)

        def gate_asked() -> float | None:  # the other API server's share: a second behind
            n = endpoint.scrape().total(CALLS, method="has_work") - then.total(
                CALLS, method="has_work"
            )
            return n if n >= len(ENGINES) else None

        gated = web.wait_for(gate_asked, 10, "the gate's has_work calls counted")
        print(f"scenario 13c (in-process): calls over 4 s {asked}, the gate's has_work {gated}")

    @pytest.mark.vllm_needs("has_work", "pause_scheduler", "resume_scheduler")
    def test_scenario12b_pause_wait_answers_once_the_generation_finished(
        self, served: PluginServer
    ) -> None:
        """``POST /dp/admin/pause?mode=wait`` (with the token) during a long generation:
        answered once it finished, every engine paused and drained (verified); resumed through
        ``/dp/admin/resume``, completions flow again."""
        with ActivityLog(served.endpoint.status) as log:
            seen = pause_wait_during_generation(served.endpoint, served.api_url)
        print(
            f"scenario 12b (in-process): pause answered after {seen.pause_took_s:.1f}s, the "
            f"stream ended {seen.stream_end_after_answer_s:+.2f}s from the answer; "
            f"{seen.generation.timeline(log.since)}; timeline: {log.timeline()}"
        )


# -- 8b: installed, configured, not allow-listed ------------------------------------------------


@pytest.fixture(scope="class")
def unlisted(
    plugin_runtime: VllmRuntime, class_procs: ProcessGroup, token: tuple[Path, str]
) -> PluginServer:
    return start_unlisted_server(plugin_runtime, class_procs, *token)


@pytest.mark.vllm_needs(ENDPOINT_PLUGINS)
class TestPluginNotAllowListed:
    def test_scenario8b_vllm_serves_as_if_the_package_were_not_there(
        self, unlisted: PluginServer
    ) -> None:
        url = unlisted.api_url
        assert web.get(f"{url}/dp/status").status == 404
        assert unlisted.endpoint.admin("reset_prefix_cache").status == 404
        metrics = web.get(f"{url}/metrics")
        assert metrics.status == 200
        text = metrics.body.decode()
        assert "vllm:num_requests_running" in text
        assert "vllm_dp_" not in text
        assert "/dp/status" not in web.get(f"{url}/openapi.json").json()["paths"]
        assert complete(url, PROMPT, 8)["usage"]["completion_tokens"] == 8
        log = unlisted.server.log_text()
        assert NOT_ALLOWED_WARNING in log
        assert "Loaded endpoint plugin" not in log


# -- 8c: the exporter inside a trainer's process -------------------------------------------------


@pytest.fixture(scope="class")
def trainer(
    plugin_runtime: VllmRuntime, class_procs: ProcessGroup, token: tuple[Path, str]
) -> Iterator[Trainer]:
    yield start_trainer(plugin_runtime, class_procs, *token)


@pytest.mark.vllm_needs("get_weight_version", "is_scheduler_paused")
class TestEmbeddedTrainer:
    def test_scenario8c_metrics_and_status_per_engine(self, trainer: Trainer) -> None:
        endpoint = trainer.endpoint
        assert trainer.ready["tokens"] == 8  # the trainer generated through its AsyncLLM
        for _ in range(5):
            scrape = endpoint.scrape()
            assert_engine_series(scrape)
            assert_families_once(scrape.text)
        status = endpoint.status()
        assert status["attach"] == "inprocess" and status["engines_connected"] == 2
        for method in ("is_sleeping", "is_scheduler_paused"):
            assert per_engine(status, method) == [(e, "ok", False) for e in ENGINES]
        assert per_engine(status, "get_weight_version") == [(e, "ok", "default") for e in ENGINES]
        polls = status["last_poll"]["number"]
        web.wait_for(
            lambda: endpoint.status()["last_poll"]["number"] >= polls + 2,
            POLL_WAIT_S,
            "two more polls",
        )

    def test_scenario8c_reset_through_the_admin_listener(self, trainer: Trainer) -> None:
        endpoint = trainer.endpoint
        assert endpoint.admin("reset_prefix_cache", token=None).status == 401
        reply = endpoint.reset()
        assert reply.status == 200, reply.body
        assert reasons(reply.json()) == [(e, True, None) for e in ENGINES]
        scrape = endpoint.scrape()
        assert scrape.value("vllm_dp_prefix_cache_resets_total", outcome="success") == 1

    def test_scenario8c_sigterm_stops_the_trainer_cleanly(self, trainer: Trainer) -> None:
        pgid = trainer.proc.pid
        started = time.monotonic()
        code = trainer.terminate(STOP_TIMEOUT_S)
        took = time.monotonic() - started
        assert code == 0, (code, trainer.proc.tail(30))
        assert [e["event"] for e in trainer.events()][-2:] == ["stopping", "stopped"]
        # Nothing left behind: the engines and their workers exited with the trainer.
        web.wait_for(lambda: not group_alive(pgid), 20, "the trainer's processes to exit")
        print(f"trainer stopped in {took:.1f} s")
