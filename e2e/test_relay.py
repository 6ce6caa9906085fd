"""Relay mode beside a real stock vLLM front end (docs/e2e.md, scenarios 3, 4, 9, 11 and 12).

The front end serves completions from 2 headless engines that dialled the exporter's relay
port; the exporter has its own client slot on both engines. Started once for the module.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq

from e2e import web
from e2e.activity import (
    LONG_ACTIVITY_TOKENS,
    ActivityLog,
    activities,
    generation_is_work_then_drains,
    pause_wait_during_generation,
)
from e2e.exporter_proc import ExporterProc, relay_args, start_exporter
from e2e.ports import free_port, free_port_range
from e2e.procs import Managed, ProcessGroup, cli_flags, first_exited
from e2e.traffic import (
    LongGeneration,
    complete,
    completions_while_resetting,
    front_end_generated,
    paused_keeping_requests,
    start_long_generations,
)
from e2e.vllm_runtime import READY_TIMEOUT_S, VllmRuntime, engine_core_pids, wait_api_ready

pytestmark = pytest.mark.timeout(900)

PROMPT = "w1 w2 w3 w4"
# As long as the context allows (4096): one generation alone runs for seconds on an idle
# machine (a few hundred tokens a second); 12 of them, about 6 per engine batched together, keep
# both engines busy far longer, so they hold KV blocks while the refused resets are sent, however
# late the busy front end streams the first token. An attempt in which no engine was busy at the
# pause runs again. (Not --max-num-seqs 1: tried, vLLM 0.32's pause with mode=keep then did not
# answer within 60 s while requests waited for a slot.)
LONG_TOKENS = 4000
GENERATIONS = 12
RESET_ATTEMPTS = 3
KV_TOPIC = "kv-e2e"
KV_EVENTS_CONFIG = json.dumps(
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0", "topic": KV_TOPIC}
)
# Longer than one KV block (128 tokens on CPU), so a completion stores at least one block.
BLOCK_PROMPT = " ".join(f"w{i}" for i in range(300))


@dataclass
class RelayDeployment:
    front_end: Managed
    engines: Managed
    exporter: ExporterProc
    api_url: str


@pytest.fixture(scope="module")
def relay(
    runtime: VllmRuntime, procs: ProcessGroup, tmp_path_factory: pytest.TempPathFactory
) -> RelayDeployment:
    front_handshake, relay_port, api_port = free_port(), free_port(), free_port()
    api_url = f"http://127.0.0.1:{api_port}"
    state_file: Path = tmp_path_factory.mktemp("relay") / "relay-state.json"
    # Dev mode only adds the front end's RL routes (/pause, /resume) used by one test.
    front_end = procs.start(
        "vllm-front-end",
        runtime.front_end(front_handshake, api_port),
        runtime.env({"VLLM_SERVER_DEV_MODE": "1"}),
    )
    # State changes allowed: scenario 12b pauses (mode=wait) and resumes through the exporter.
    exporter = start_exporter(
        procs,
        "exporter",
        [
            *relay_args(relay_port, front_handshake, free_port_range(3), state_file),
            *cli_flags(relay_allow_state_changes="true"),
        ],
    )
    # KV events on (scenario 9): each engine binds its publisher on a free loopback port
    # (tcp://*:0 with VLLM_HOST_IP: vLLM resolves it to that address) and registers it.
    engines = procs.start(
        "vllm-engines",
        [*runtime.headless_engines(relay_port), "--kv-events-config", KV_EVENTS_CONFIG],
        runtime.env({"VLLM_HOST_IP": "127.0.0.1"}),
    )
    exporter.wait_ready(READY_TIMEOUT_S, engines, front_end)
    wait_api_ready(api_url, front_end, engines)
    return RelayDeployment(front_end, engines, exporter, api_url)


def assert_confirmed_by_both(reply: web.Reply) -> None:
    body = reply.json()
    assert reply.status == 200, body
    assert body["outcome"] == "success"
    assert [(e["engine"], e["ok"]) for e in body["engines"]] == [(0, True), (1, True)]


def not_ok_calls(scrape: web.Scrape, engine: str) -> float:
    return scrape.total("vllm_dp_utility_calls_total", engine=engine) - scrape.total(
        "vllm_dp_utility_calls_total", engine=engine, outcome="ok"
    )


def text_of(completion: dict[str, Any]) -> str:
    return str(completion["choices"][0]["text"])


@pytest.mark.smoke
def test_scenario3_completions_flow_while_the_exporter_polls_and_resets(
    relay: RelayDeployment,
) -> None:
    exporter, api = relay.exporter, relay.api_url
    scrape = exporter.scrape()
    assert scrape.value("vllm_dp_relay_handshakes_total", result="completed") == 2
    assert scrape.value("vllm_dp_engines_connected") == 2
    assert exporter.status()["aggregate"]["is_sleeping"]["value"] is False

    before = complete(api, PROMPT, 16)
    assert before["usage"]["completion_tokens"] == 16
    start = exporter.scrape()

    # During: 8 completions on 2 client threads while the exporter polls every second and
    # resets (preempting running requests, so every reset is confirmed) as fast as it can.
    during, resets = completions_while_resetting(
        api, PROMPT, lambda: exporter.reset(reset_running_requests=True)
    )
    assert all(c["usage"]["completion_tokens"] == 128 for c in during)
    assert all(c["choices"][0]["finish_reason"] == "length" for c in during)
    assert len(resets) >= 3
    for reply in resets:
        assert_confirmed_by_both(reply)

    # After: the same greedy answer as before, and a plain reset is confirmed by both engines.
    after = complete(api, PROMPT, 16)
    assert text_of(after) == text_of(before)
    assert_confirmed_by_both(exporter.reset())

    end = exporter.scrape()
    assert end.total("vllm_dp_polls_total") >= start.total("vllm_dp_polls_total") + 2
    assert end.value("vllm_dp_prefix_cache_resets_total", outcome="success") == len(resets) + 1
    for engine in ("0", "1"):
        assert end.value("vllm_dp_engine_up", engine=engine) == 1
        # Every call since the engines were ready was answered (before the engines dialled
        # in, the polls counted them disconnected).
        assert not_ok_calls(end, engine) == not_ok_calls(start, engine)
        assert end.total("vllm_dp_utility_calls_total", engine=engine, outcome="ok") > (
            start.total("vllm_dp_utility_calls_total", engine=engine, outcome="ok")
        )
    assert end.total("vllm_dp_protocol_errors_total") == 0


@pytest.mark.smoke
@pytest.mark.vllm_needs("POST /pause", "POST /resume", "is_scheduler_paused")
def test_scenario3_a_paused_front_end_shows_as_paused_engines_not_asleep(
    relay: RelayDeployment,
) -> None:
    """The front end's /pause reaches every engine; the exporter's own slot sees each engine's
    scheduler paused (``is_sleeping`` is true while paused, ``is_scheduler_paused`` tells)."""
    exporter, api = relay.exporter, relay.api_url
    paused = web.post(f"{api}/pause?mode=keep", timeout_s=60)
    assert paused.status == 200, paused.body
    try:
        web.wait_for(
            lambda: exporter.status()["aggregate"]["is_scheduler_paused"]["value"] is True,
            15,
            "the exporter to see both engines paused",
        )
        scrape = exporter.scrape()
        for engine in ("0", "1"):
            assert scrape.value("vllm_dp_engine_paused", engine=engine) == 1
            assert scrape.value("vllm_dp_engine_sleeping", engine=engine) == 1
            assert scrape.value("vllm_dp_engine_state", engine=engine, state="paused") == 1
            assert scrape.value("vllm_dp_engine_state", engine=engine, state="asleep") == 0
        assert scrape.value("vllm_dp_sleep_state_consistent") == 1
    finally:
        resumed = web.post(f"{api}/resume")
    assert resumed.status == 200, resumed.body
    web.wait_for(
        lambda: exporter.status()["aggregate"]["is_sleeping"]["value"] is False,
        15,
        "the exporter to see both engines awake again",
    )
    assert complete(api, PROMPT, 8)["usage"]["completion_tokens"] == 8


def _refused_while_paused(
    exporter: ExporterProc, api: str, attempts: list[str]
) -> tuple[list[LongGeneration], web.Reply, dict[str, float]] | None:
    """Long generations, the engines paused by the exporter with ``mode=keep`` as soon as the
    first one streams, then a reset that must not preempt them; returns the generations, the reset's
    answer and the counters before it, or None when no engine was busy at the pause (retry);
    ``attempts`` gets one line of timings per attempt."""
    started = time.monotonic()
    before = exporter.scrape()
    counters = {
        outcome: before.total("vllm_dp_prefix_cache_resets_total", outcome=outcome)
        for outcome in ("failure", "partial_failure")
    } | {
        engine: before.value(
            "vllm_dp_prefix_cache_reset_engine_failures_total", engine=engine, reason="refused"
        )
        or 0.0
        for engine in ("0", "1")
    }
    gens = start_long_generations(api, GENERATIONS, LONG_TOKENS, allow_ended=True, wait_all=False)
    # Paused with mode=keep, the running requests keep their KV blocks however fast this CPU
    # generates, so the refusals below cannot race the end of the generations. Paused by the
    # exporter (this deployment allows it state changes), straight to the engines: the front
    # end, streaming 12 generations, sent its own pause late, after they had ended (CI).
    with paused_keeping_requests(api, exporter.status, exporter.admin):
        paused_at = time.monotonic() - started
        # vLLM refuses a prefix-cache reset while running requests hold KV blocks: each engine
        # the front end's load balancer gave a generation refuses, the others confirm.
        refused = exporter.reset(reset_running_requests=False)
        body = refused.json()
        failed = body.get("failed_engines")
        line = f"paused +{paused_at:.1f}s, reset {refused.status} failed_engines={failed}; "
        if refused.status == 502 and failed:
            assert {e["reason"] for e in body["engines"] if not e["ok"]} == {"refused"}, body
            ctl = exporter.ctl("reset-prefix-cache", "--admin-url", exporter.admin_url, "--json")
            assert ctl.returncode == 2, (ctl.stdout, ctl.stderr)
            again = json.loads(ctl.stdout)
            assert again["failed_engines"] == failed, (body, again)
            print("scenario 4: " + line + "; ".join(g.timeline(started) for g in gens))
            return gens, refused, counters
    # Both engines accepted: their generations had ended before the pause took hold. Not what
    # this test is about: wait for them, then again.
    assert refused.status == 200, body
    for gen in gens:
        gen.result(600)
    attempts.append(line + "; ".join(g.timeline(started) for g in gens))
    return None


@pytest.mark.vllm_needs("POST /pause", "POST /resume")
def test_scenario4_reset_refused_by_engines_with_running_requests(
    relay: RelayDeployment,
) -> None:
    exporter, api = relay.exporter, relay.api_url
    attempts: list[str] = []
    for _attempt in range(RESET_ATTEMPTS):
        found = _refused_while_paused(exporter, api, attempts)
        if found is not None:
            break
    else:
        raise AssertionError(
            f"no attempt of {RESET_ATTEMPTS} had an engine busy at the pause:\n"
            + "\n".join(attempts)
        )
    gens, refused, before = found
    body = refused.json()
    busy = [str(e) for e in body["failed_engines"]]
    # The answer names each busy engine (refused) and confirms the others.
    assert [(str(e["engine"]), e["ok"], e["reason"]) for e in body["engines"]] == [
        (engine, engine not in busy, "refused" if engine in busy else None) for engine in ("0", "1")
    ]
    outcome = "failure" if len(busy) == 2 else "partial_failure"
    assert body["outcome"] == outcome, body

    scrape = exporter.scrape()
    # The reset and ctl's: both counted, each refusal counted on its engine alone.
    assert scrape.total("vllm_dp_prefix_cache_resets_total", outcome=outcome) == (
        before[outcome] + 2
    )
    for engine in ("0", "1"):
        assert scrape.value(
            "vllm_dp_prefix_cache_reset_engine_failures_total", engine=engine, reason="refused"
        ) == before[engine] + (2 if engine in busy else 0)
        assert scrape.value("vllm_dp_engine_up", engine=engine) == 1

    # The same reset preempting the running requests is confirmed by both engines, and the
    # preempted requests still finish (recomputed) with every token.
    assert_confirmed_by_both(exporter.reset(reset_running_requests=True))
    assert [g.result(600) for g in gens] == [LONG_TOKENS] * GENERATIONS
    assert {g.finish_reason for g in gens} == {"length"}

    # Nothing runs any more: a plain reset is confirmed again.
    assert_confirmed_by_both(exporter.reset())


def _subscribe(context: zmq.Context[zmq.Socket[bytes]], target: str) -> zmq.Socket[bytes]:
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://{target}")
    return sub


def _events_until(subs: list[zmq.Socket[bytes]], marker: bytes, timeout_s: float) -> int:
    """The index of the first socket that receives a batch naming ``marker`` (vLLM's
    msgpack tags its events by class name), within ``timeout_s``."""
    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(500):
            frames = sock.recv_multipart()  # topic, sequence, payload
            if frames[0] == KV_TOPIC.encode() and marker in frames[-1]:
                return subs.index(sock)
    raise AssertionError(f"no {marker.decode()} event within {timeout_s}s")


@pytest.mark.vllm_needs("registration:kv_events_config")
def test_scenario9_kv_events_targets_and_reset_times(relay: RelayDeployment) -> None:
    """Every rank's KV-events publisher from the exporter's http_sd document; a completion
    stores blocks there; a reset moves that rank's reset time at once, and its
    AllBlocksCleared arrives with the next completion (vLLM publishes at the next step)."""
    exporter, api = relay.exporter, relay.api_url
    reply = web.get(f"{exporter.url}/kv_events_targets")
    assert reply.status == 200, reply.body
    groups = reply.json()
    assert [g["labels"]["engine"] for g in groups] == ["0", "1"], groups
    assert all(g["labels"]["topic"] == KV_TOPIC for g in groups)
    targets = [g["targets"][0] for g in groups]
    assert all(t.startswith("127.0.0.1:") for t in targets) and len(set(targets)) == 2
    before = {str(e["engine"]): e["prefix_cache"] for e in exporter.status()["engines"]}

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    subs = [_subscribe(context, t) for t in targets]
    try:
        time.sleep(1.0)  # ZMQ's slow joiner: let both subscriptions reach the publishers
        complete(api, BLOCK_PROMPT, 4)
        stored_on = _events_until(subs, b"BlockStored", 60)
        assert_confirmed_by_both(exporter.reset())
        after = {str(e["engine"]): e["prefix_cache"] for e in exporter.status()["engines"]}
        for engine in ("0", "1"):
            assert after[engine]["confirmed_resets"] == before[engine]["confirmed_resets"] + 1
            assert after[engine]["last_reset_unix"] is not None
            assert after[engine]["last_reset_unix"] > time.time() - 60
        scrape = exporter.scrape()
        assert scrape.value(
            "vllm_dp_prefix_cache_last_reset_timestamp_seconds", engine=str(stored_on)
        ) == pytest.approx(after[str(stored_on)]["last_reset_unix"], abs=1.0)
        # The same prompt again: vLLM's load balancer may place it on either engine; each
        # publishes its AllBlocksCleared with its next step.
        complete(api, BLOCK_PROMPT, 4)
        complete(api, BLOCK_PROMPT + " again", 4)
        _events_until(subs, b"AllBlocksCleared", 60)
    finally:
        for sub in subs:
            sub.close()
        context.term()


def test_scenario11_a_stopped_engine_is_hung_not_down_then_routable_again(
    relay: RelayDeployment,
) -> None:
    """SIGSTOP on rank 1's engine process (a frozen busy loop: vLLM's /health stays 200): it
    becomes ``hung`` within --hung-after (automatic: 5 s here) plus two polls, not
    disconnected or dead; rank 0 keeps answering; no inconsistency is counted; /routable and
    /readyz?engine=1 leave it out. SIGCONT: routable again within a few polls, by itself."""
    exporter = relay.exporter
    pid = engine_core_pids(relay.engines)[1]
    before = exporter.scrape().total("vllm_dp_inconsistent_utility_results_total")
    handshakes = exporter.status()["engines"][1]["handshakes"]
    os.kill(pid, signal.SIGSTOP)
    try:

        def hung() -> dict[str, Any] | None:
            doc = exporter.status()
            return doc if doc["engines"][1]["state"] == "hung" else None

        doc = web.wait_for(hung, 60, "rank 1 hung", abort=lambda: first_exited(relay.engines))
        one, zero = doc["engines"][1], doc["engines"][0]
        assert one["connected"] and one["unresponsive_seconds"] >= 5, one
        assert not one["routable"]["routable"]
        assert zero["state"] == "awake" and zero["up"] and zero["routable"]["routable"], zero
        routable = web.get(f"{exporter.url}/routable").json()
        assert routable["routable_engines"] == ["0"], routable
        assert web.get(f"{exporter.url}/readyz?engine=1").status == 503
        assert web.get(f"{exporter.url}/readyz?engine=0").status == 200
        after = exporter.scrape()
        assert after.total("vllm_dp_inconsistent_utility_results_total") == before
        assert after.value("vllm_dp_engine_state", engine="1", state="hung") == 1.0
    finally:
        os.kill(pid, signal.SIGCONT)

    def routable_again() -> bool:
        return web.get(f"{exporter.url}/readyz?engine=1").status == 200

    web.wait_for(
        routable_again, 60, "rank 1 routable again", abort=lambda: first_exited(relay.engines)
    )
    assert exporter.status()["engines"][1]["handshakes"] == handshakes  # no new handshake


@pytest.mark.vllm_needs("has_work")
def test_scenario12a_a_generation_is_work_on_its_rank_the_other_is_drained(
    relay: RelayDeployment,
) -> None:
    """One long streamed generation pinned to a rank (``X-data-parallel-rank``): the rank
    the exporter shows with work (``/status``
    activity, ``vllm_dp_engine_has_work`` 1, and ``running`` ≥ 1: the relay follows the DP
    coordinator's publication to the front end) is the rank whose tokens the front end's own
    counter counted (checked after the stream: that /metrics can take seconds to answer while
    vLLM streams), the other is drained; ``/gate?drained=true`` 412 naming that rank alone,
    with its counts; 200 again within 60 s of the stream's end (e2e/activity.py)."""

    before: dict[str, float] = {}

    def count_before() -> None:  # each attempt's own generation is the one checked
        before.clear()
        before.update(front_end_generated(relay.api_url))

    def busy_rank() -> str | None:
        acts = activities(relay.exporter.status())
        running = [e for e, a in acts.items() if a["has_work"] and (a["running"] or 0) >= 1]
        return running[0] if len(running) == 1 else None

    with ActivityLog(relay.exporter.status) as log:
        seen = generation_is_work_then_drains(
            relay.exporter,
            relay.api_url,
            busy_rank,
            counts_known=True,
            log=log,
            before_generation=count_before,
        )
    after = front_end_generated(relay.api_url)
    grew = {e: after.get(e, 0.0) - before.get(e, 0.0) for e in after}
    assert grew[seen.busy] >= LONG_ACTIVITY_TOKENS, (seen.busy, grew)
    assert all(n < LONG_ACTIVITY_TOKENS for e, n in grew.items() if e != seen.busy), grew
    print(
        f"scenario 12a (relay): rank {seen.busy} busy, seen +{seen.seen_after_s:.1f}s after "
        f"the request; {seen.generation.timeline(log.since)}; gate 200 "
        f"{seen.drained_after_s:.2f}s after the stream ended; timeline: {log.timeline()}"
    )


@pytest.mark.vllm_needs("has_work", "pause_scheduler", "resume_scheduler")
def test_scenario12b_pause_wait_answers_once_the_generation_finished(
    relay: RelayDeployment,
) -> None:
    """``POST /admin/pause?mode=wait`` during a long generation (this deployment's exporter
    runs with --relay-allow-state-changes): answered once the generation finished, every
    engine paused and drained (verified); resumed, completions flow again."""
    with ActivityLog(relay.exporter.status) as log:
        seen = pause_wait_during_generation(relay.exporter, relay.api_url)
    print(
        f"scenario 12b (relay): pause answered after {seen.pause_took_s:.1f}s, the stream "
        f"ended {seen.stream_end_after_answer_s:+.2f}s from the answer; "
        f"{seen.generation.timeline(log.since)}; timeline: {log.timeline()}"
    )
