"""The exporter beside vLLM's Rust front end (``vllm-rs``, ``VLLM_USE_RUST_FRONTEND=1``;
docs/e2e.md, scenario 13): relay mode with the Rust front end as the handshake's upstream, and
HTTP mode reading the Rust front end's dev routes while its two engines disagree for real.

The binary comes from vLLM's GPU wheel of the version under test (``e2e/rust_front_end.py``:
downloaded once, skipped naming why when the release has none or PyPI cannot be reached). The
engines are the CPU build's own, as everywhere in the suite.

* ``TestRelayBesideTheRustFrontEnd``: one headless launcher (2 engines) dials the exporter in
  relay mode, which relays both handshakes to the Rust front end (no local engines).
* ``TestHttpModeAgainstTheRustFrontEnd``: one headless launcher per rank, each dialling its own
  relay exporter (``--start-rank``, ``--engine-count 1``, ``--relay-allow-state-changes``), both
  relaying to the same Rust front end; an HTTP-mode exporter polls the Rust front end. A pause
  or a weight version sent through one relay reaches that rank alone, so the Rust front end's
  consensus fails for real ("utility call `is_sleeping` returned inconsistent results across
  engines: [false, true]") and the HTTP-mode exporter must read it as inconsistent.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import pytest

from e2e import plugin_install, web
from e2e.activity import activities
from e2e.exporter_proc import ExporterProc, http_args, relay_args, start_exporter
from e2e.ports import HOST, free_port, free_port_range
from e2e.procs import Managed, ProcessGroup, cli_flags
from e2e.rust_front_end import RustFrontEnd, RustFrontEndUnavailable, fetch_binary, headless_rank
from e2e.traffic import (
    complete,
    completions_while_resetting,
    paused_keeping_requests,
    start_long_generations,
)
from e2e.vllm_runtime import READY_TIMEOUT_S, VllmRuntime, wait_api_ready

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.vllm_needs(
        "POST /pause", "POST /resume", "GET /is_sleeping", "GET /is_paused", "GET /weight_info",
        "is_scheduler_paused", "get_weight_version", "set_weight_version",
    ),
]  # fmt: skip

PROMPT = "w1 w2 w3 w4"
ENGINES = ("0", "1")
#: One streamed generation this long holds its engine for seconds (about 13 s on an idle
#: machine); the front end is paused (mode=keep) as soon as it streams, so it holds its KV
#: blocks while the reset is refused.
LONG_TOKENS = 4000
#: Attempts at a pause that catches the generation still running on its engine.
REFUSAL_ATTEMPTS = 3
#: The HTTP-mode exporter's name for the Rust front end (one target: one engine to it).
TARGET = "rs"


@pytest.fixture(scope="module")
def rust_front_end(runtime: VllmRuntime) -> RustFrontEnd:
    """``vllm-rs`` of the vLLM under test, or the module skipped naming why there is none."""
    try:
        binary = fetch_binary(runtime.version, runtime.venv / "bin" / "python")
    except RustFrontEndUnavailable as exc:
        pytest.skip(f"no Rust front end (vllm-rs) for vLLM {runtime.version}: {exc}")
    return RustFrontEnd(runtime, binary)


def front_end_generated(api: str) -> dict[str, float]:
    """Engine → the Rust front end's own ``vllm:generation_tokens_total`` (OpenMetrics)."""
    scrape = web.Scrape(web.get(f"{api}/metrics", timeout_s=30.0).body.decode())
    return {
        str(s.labels["engine"]): float(s.value)
        for s in scrape.find("vllm:generation_tokens_total")
        if "engine" in s.labels
    }


def assert_confirmed_by_both(reply: web.Reply) -> None:
    body = reply.json()
    assert reply.status == 200, body
    assert [(str(e["engine"]), e["ok"]) for e in body["engines"]] == [("0", True), ("1", True)]


def not_ok_calls(scrape: web.Scrape, engine: str) -> float:
    return scrape.total("vllm_dp_utility_calls_total", engine=engine) - scrape.total(
        "vllm_dp_utility_calls_total", engine=engine, outcome="ok"
    )


# -- relay mode: the Rust front end as the handshake's upstream --------------------------------


@dataclass
class RelayBesideRust:
    front_end: Managed
    engines: Managed
    exporter: ExporterProc
    api_url: str


@pytest.fixture(scope="class")
def relay_rust(
    rust_front_end: RustFrontEnd,
    class_procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
) -> RelayBesideRust:
    runtime = rust_front_end.runtime
    # The checkout in vLLM's environment: its general-plugin hook must say, in vllm serve's
    # own log, that the in-process plugin cannot run here (docs/inprocess.md).
    plugin_install.install(runtime.version)
    front_handshake, relay_port, api_port = free_port(), free_port(), free_port()
    api_url = f"http://{HOST}:{api_port}"
    front_end = class_procs.start(
        "vllm-rust-front-end",
        rust_front_end.front_end(front_handshake, api_port),
        rust_front_end.env(),
    )
    state_file = tmp_path_factory.mktemp("relay-rust") / "relay-state.json"
    exporter = start_exporter(
        class_procs,
        "exporter",
        relay_args(relay_port, front_handshake, free_port_range(3), state_file),
    )
    engines = class_procs.start("vllm-engines", runtime.headless_engines(relay_port), runtime.env())
    exporter.wait_ready(READY_TIMEOUT_S, engines, front_end)
    wait_api_ready(api_url, front_end, engines)
    return RelayBesideRust(front_end, engines, exporter, api_url)


class TestRelayBesideTheRustFrontEnd:
    def test_vllm_serve_says_once_that_the_plugin_cannot_run_under_the_rust_front_end(
        self, relay_rust: RelayBesideRust
    ) -> None:
        """The package's ``vllm.general_plugins`` hook, called by vLLM itself: one WARNING in
        ``vllm serve``'s own process (not in the engines' processes, whose log is apart)."""
        said = relay_rust.front_end.log_text().count("runs vLLM's Rust front end, which loads no")
        assert said == 1, relay_rust.front_end.tail(80)
        assert "runs vLLM's Rust front end" not in relay_rust.engines.log_text()

    def test_completions_flow_through_the_rust_front_end_while_the_exporter_polls(
        self, relay_rust: RelayBesideRust
    ) -> None:
        exporter, api = relay_rust.exporter, relay_rust.api_url
        version = web.get(f"{api}/version").json()
        assert "rust_frontend_version" in version, version  # the Rust front end answers
        scrape = exporter.scrape()
        assert scrape.value("vllm_dp_relay_handshakes_total", result="completed") == 2
        assert scrape.value("vllm_dp_engines_connected") == 2
        status = exporter.status()
        assert status["aggregate"]["is_sleeping"]["value"] is False
        assert [(str(e["engine"]), e["state"]) for e in status["engines"]] == [
            ("0", "awake"),
            ("1", "awake"),
        ]
        for engine in status["engines"]:
            assert engine["invariants"]["is_sleeping"]["value"] is False, engine
            assert engine["invariants"]["is_scheduler_paused"]["value"] is False, engine
            assert engine["invariants"]["get_weight_version"]["value"] == "default", engine

        generated_before = front_end_generated(api)
        before = complete(api, PROMPT, 16)
        assert before["usage"]["completion_tokens"] == 16
        start = exporter.scrape()
        # 8 completions on 2 client threads through the Rust front end while the exporter
        # polls every second and resets (preempting running requests) back to back.
        during, resets = completions_while_resetting(
            api, PROMPT, lambda: exporter.reset(reset_running_requests=True)
        )
        assert all(c["usage"]["completion_tokens"] == 128 for c in during)
        assert len(resets) >= 2
        for reply in resets:
            assert_confirmed_by_both(reply)
        after = complete(api, PROMPT, 16)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]

        end = exporter.scrape()
        assert end.total("vllm_dp_polls_total") >= start.total("vllm_dp_polls_total") + 2
        for engine in ENGINES:
            assert end.value("vllm_dp_engine_up", engine=engine) == 1
            assert end.value("vllm_dp_engine_sleeping", engine=engine) == 0
            assert end.value("vllm_dp_engine_paused", engine=engine) == 0
            assert not_ok_calls(end, engine) == not_ok_calls(start, engine)
            assert end.total("vllm_dp_utility_calls_total", engine=engine, outcome="ok") > (
                start.total("vllm_dp_utility_calls_total", engine=engine, outcome="ok")
            )
        assert end.total("vllm_dp_protocol_errors_total") == 0
        # Every token the Rust front end streamed, counted by its own /metrics per engine.
        generated = front_end_generated(api)
        grew = {e: generated[e] - generated_before.get(e, 0.0) for e in generated}
        assert sum(grew.values()) >= 8 * 128 + 32, grew

    def test_a_reset_is_refused_by_the_engine_holding_a_long_generation(
        self, relay_rust: RelayBesideRust
    ) -> None:
        """One long streamed generation through the Rust front end, its engine paused with
        ``mode=keep&clear_cache=false`` (the Rust front end's own /pause) as soon as it streams:
        the exporter's reset is refused by that engine alone (502 ``partial_failure``), counted
        on it alone; the reset that preempts running requests is confirmed by both and the
        generation still completes."""
        exporter, api = relay_rust.exporter, relay_rust.api_url
        attempts: list[str] = []
        for _ in range(REFUSAL_ATTEMPTS):
            generated = front_end_generated(api)
            counted = {
                e: exporter.scrape().value(
                    "vllm_dp_prefix_cache_reset_engine_failures_total", engine=e, reason="refused"
                )
                or 0.0
                for e in ENGINES
            }
            started = time.monotonic()
            gens = start_long_generations(api, 1, LONG_TOKENS, allow_ended=True)
            with paused_keeping_requests(api, exporter.status):
                reply = exporter.reset(reset_running_requests=False)
                body = reply.json()
                line = (
                    f"reset {reply.status} {body.get('failed_engines')}; "
                    f"{gens[0].timeline(started)}"
                )
                if reply.status == 502:
                    # Printed, not asserted: a scheduler paused with mode=keep answers
                    # has_work false while it holds its running requests (vLLM 0.32's
                    # Scheduler.get_num_unfinished_requests is 0 under PAUSED_ALL).
                    seen = activities(exporter.status())
                    break
            attempts.append(line)  # the generation ended before the pause held: again
            assert reply.status == 200, body
            gens[0].result(600)
        else:
            raise AssertionError("no attempt refused:\n" + "\n".join(attempts))
        assert body["outcome"] == "partial_failure", body
        assert len(body["failed_engines"]) == 1, body
        busy = str(body["failed_engines"][0])
        assert [(str(e["engine"]), e["ok"], e["reason"]) for e in body["engines"]] == [
            (e, e != busy, "refused" if e == busy else None) for e in ENGINES
        ]
        scrape = exporter.scrape()
        for e in ENGINES:
            assert scrape.value(
                "vllm_dp_prefix_cache_reset_engine_failures_total", engine=e, reason="refused"
            ) == counted[e] + (1 if e == busy else 0)
            assert scrape.value("vllm_dp_engine_up", engine=e) == 1

        assert_confirmed_by_both(exporter.reset(reset_running_requests=True))
        assert gens[0].result(600) == LONG_TOKENS
        assert gens[0].finish_reason == "length"
        # The refusing engine is the one that generated the tokens (the Rust front end's own
        # per-engine counter).
        grew = {e: n - generated.get(e, 0.0) for e, n in front_end_generated(api).items()}
        print(f"rust front end, relay refusal: busy {busy}, {line}; grew {grew}; seen {seen}")
        assert grew[busy] >= LONG_TOKENS, (busy, grew)
        assert all(grew[e] < LONG_TOKENS for e in ENGINES if e != busy), grew
        assert_confirmed_by_both(exporter.reset())


# -- HTTP mode: the Rust front end's dev routes, its two engines made to disagree --------------


@dataclass
class SplitRelays:
    """Two ranks under two launchers, each relayed by its own exporter to one Rust front end,
    and an HTTP-mode exporter polling that front end."""

    front_end: Managed
    launchers: list[Managed]
    relays: list[ExporterProc]
    http: ExporterProc
    api_url: str


@pytest.fixture(scope="class")
def split_relays(
    rust_front_end: RustFrontEnd,
    class_procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
) -> SplitRelays:
    runtime = rust_front_end.runtime
    front_handshake, api_port = free_port(), free_port()
    api_url = f"http://{HOST}:{api_port}"
    front_end = class_procs.start(
        "vllm-rust-front-end",
        rust_front_end.front_end(front_handshake, api_port),
        rust_front_end.env(),
    )
    state_dir = tmp_path_factory.mktemp("split-relays")
    relays, launchers = [], []
    for rank in (0, 1):
        relay_port = free_port()
        # State changes allowed: this exporter's pause and weight version reach its rank alone.
        relays.append(
            start_exporter(
                class_procs,
                f"relay-{rank}",
                [
                    *relay_args(
                        relay_port,
                        front_handshake,
                        free_port_range(2),
                        state_dir / f"relay-{rank}.json",
                        count=1,
                    ),
                    *cli_flags(start_rank=rank, relay_allow_state_changes="true"),
                ],
            )
        )
        launchers.append(
            class_procs.start(
                f"vllm-engine-{rank}", headless_rank(runtime, relay_port, rank), runtime.env()
            )
        )
    for relay in relays:
        relay.wait_ready(READY_TIMEOUT_S, front_end, *launchers)
    wait_api_ready(api_url, front_end, *launchers)
    http = start_exporter(class_procs, "exporter-http", http_args({TARGET: api_url}))
    http.wait_ready(60, front_end, *launchers)
    return SplitRelays(front_end, launchers, relays, http, api_url)


def _aggregate(exporter: ExporterProc, method: str) -> dict[str, Any]:
    verdict: dict[str, Any] = exporter.status()["aggregate"][method]
    return verdict


def _inconsistent(exporter: ExporterProc, method: str) -> dict[str, Any] | None:
    verdict = _aggregate(exporter, method)
    return verdict if verdict["state"] == "inconsistent" else None


def _consistent(exporter: ExporterProc, method: str, value: Any) -> bool:
    verdict = _aggregate(exporter, method)
    return bool(verdict["state"] == "consistent" and verdict["value"] == value)


def _counted(exporter: ExporterProc) -> dict[str, float]:
    scrape = exporter.scrape()
    return {
        m: scrape.total("vllm_dp_inconsistent_utility_results_total", method=m)
        for m in ("is_sleeping", "is_scheduler_paused", "get_weight_version")
    }


def _target_with_version(exporter: ExporterProc) -> dict[str, Any] | None:
    """The HTTP-mode exporter's one target once its ``GET /version`` was read."""
    engine: dict[str, Any] = exporter.status()["engines"][0]
    return engine if engine["vllm_version"] else None


def _relay_states(split: SplitRelays) -> list[list[tuple[str, str]]]:
    """Each relay's engines with their state, in relay order."""
    return [[(str(e["engine"]), e["state"]) for e in r.status()["engines"]] for r in split.relays]


class TestHttpModeAgainstTheRustFrontEnd:
    def test_engines_disagreeing_behind_the_rust_front_end_read_as_inconsistent(
        self, split_relays: SplitRelays, runtime: VllmRuntime
    ) -> None:
        http, api = split_relays.http, split_relays.api_url
        relay1 = split_relays.relays[1]
        # Consistent first; the target is known as the Rust front end of the version under test.
        status = http.status()
        assert status["attach"] == "http" and status["engines_connected"] == 1
        for method, value in (
            ("is_sleeping", False),
            ("is_scheduler_paused", False),
            ("get_weight_version", "default"),
        ):
            assert _consistent(http, method, value), _aggregate(http, method)
        target = web.wait_for(
            lambda: _target_with_version(http), 15, "the target's GET /version read"
        )
        assert (target["front_end"], target["rust_frontend_version"], target["vllm_version"]) == (
            "rust",
            runtime.version,
            runtime.version,
        )
        reset = http.reset()
        assert reset.status == 200, reset.body
        assert reset.json()["engines"][0]["ok"] is True, reset.body
        before = _counted(http)

        # Rank 1 alone paused, through its own relay: the Rust front end's consensus fails.
        paused = relay1.admin("pause", mode="keep")
        assert paused.status == 200 and paused.json()["verified"], paused.body
        try:
            sleeping = web.wait_for(
                lambda: _inconsistent(http, "is_sleeping"), 15, "is_sleeping inconsistent"
            )
            assert sleeping["by_engine"] == {TARGET: [False, True]}, sleeping
            assert sleeping["values"] == [[False, True]], sleeping
            paused_verdict = _inconsistent(http, "is_scheduler_paused")
            assert paused_verdict is not None
            assert paused_verdict["by_engine"] == {TARGET: [False, True]}, paused_verdict
            engine = http.status()["engines"][0]
            for method in ("is_sleeping", "is_scheduler_paused"):
                answer = engine["invariants"][method]
                assert answer["outcome"] == "inconsistent", answer
                assert answer["values"] == [False, True], answer
                assert "returned inconsistent results across engines" in answer["error"], answer
            assert _consistent(http, "get_weight_version", "default")
            scrape = http.scrape()
            assert scrape.value("vllm_dp_sleep_state_consistent") == 0
            assert scrape.value("vllm_dp_fleet_state", state="inconsistent") == 1
            # Each relay sees its own rank: 0 awake, 1 paused.
            web.wait_for(
                lambda: _relay_states(split_relays) == [[("0", "awake")], [("1", "paused")]],
                15,
                "relay 0 reading rank 0 awake, relay 1 rank 1 paused",
            )

            # Rank 1 alone at another weight version: get_weight_version disagrees as well.
            version = relay1.admin("weight_version", {"weight_version": "rl-1"})
            assert version.status == 200 and version.json()["verified"], version.body
            weights = web.wait_for(
                lambda: _inconsistent(http, "get_weight_version"),
                15,
                "get_weight_version inconsistent",
            )
            assert weights["by_engine"] == {TARGET: ["default", "rl-1"]}, weights
            after = _counted(http)
            for method in ("is_sleeping", "is_scheduler_paused", "get_weight_version"):
                assert after[method] > before[method], (method, before, after)
        finally:
            resumed = relay1.admin("resume")
            restored = relay1.admin("weight_version", {"weight_version": "default"})
        assert resumed.status == 200, resumed.body
        assert restored.status == 200, restored.body
        for method, value in (
            ("is_sleeping", False),
            ("is_scheduler_paused", False),
            ("get_weight_version", "default"),
        ):
            web.wait_for(
                functools.partial(_consistent, http, method, value),
                15,
                f"{method} consistent again",
            )
        assert complete(api, PROMPT, 8)["usage"]["completion_tokens"] == 8
