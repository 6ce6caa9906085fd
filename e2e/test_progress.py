"""Forward progress and ``stalled`` per rank on real vLLM 0.32 (docs/e2e.md, scenario 14).

One deployment for the module: ``vllm serve --data-parallel-size 2`` (2 API servers, vLLM's
default) with ``VLLM_PLUGINS=dp_exporter`` (the endpoint plugin and the package's stat-logger
plugin), polling every second, ``VLLM_DP_EXPORTER_STALL_AFTER=8`` and ``--max-num-seqs 2``,
and the test-only engine hook (``e2e/engine_hook/sitecustomize.py``) on the engine processes'
``PYTHONPATH``: a file per rank in a temporary folder makes that rank hold its requests without
stepping (its busy loop still answers every utility call), another paces its steps.

* 14a: one streamed generation pinned to rank 0 (``X-data-parallel-rank``): rank 0's
  ``vllm_dp_engine_progress_tokens_total`` grows while it streams, rank 1's does not move; the
  growth is exactly vLLM's own prompt plus generation counters of that engine.
* 14b: 3 generations on rank 0 (2 run, 1 waits: ``--max-num-seqs 2``) and 1 on rank 1: each
  rank's running and waiting in ``/dp/status`` and ``vllm_dp_engine_requests`` equal vLLM's own
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` of that engine label.
* 14c: rank 0 keeps generating; rank 1 is made to hold the requests pinned to it (sent until
  each API server holds one: each judges by its own requests): every API server reads rank 1
  ``stalled`` (answering, ``has_work`` true), not routable (``/dp/routable``,
  ``/dp/readyz?engine=1`` 503, the series); rank 0 never reads stalled; once rank 1 steps
  again its requests complete and both ranks read awake and routable everywhere.

Every engine step is paced (``PACE_S``): on 2 cores the tiny model generates faster than vLLM's
front end streams, and the API server carrying a stream then answers nothing else until it has
caught up (the plugin shares its event loop).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from e2e import plugin_install, web
from e2e.activity import Sampler, pinned
from e2e.engine_hook import sitecustomize as hook
from e2e.inprocess import Endpoint, PluginServer, server_of, start_plugin_server, write_token
from e2e.procs import ProcessGroup, cli_flags, first_exited
from e2e.traffic import LongGeneration
from e2e.vllm_features import ENDPOINT_PLUGIN_OVERRIDES, ENDPOINT_PLUGINS
from e2e.vllm_runtime import VllmRuntime, engine_core_pids

pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.vllm_needs(ENDPOINT_PLUGINS, ENDPOINT_PLUGIN_OVERRIDES, "has_work"),
]

ENGINES = ("0", "1")
HOOK_DIR = Path(hook.__file__).resolve().parent
API_SERVERS = ("in-process (vLLM client 0)", "in-process (vLLM client 1)")
POLL_S = 1.0
#: ``--stall-after``: far above a step of the tiny model (milliseconds) and its prefill.
STALL_AFTER_S = 8.0
MAX_NUM_SEQS = 2
#: Each real engine step sleeps this long first (about 45 steps a second).
PACE_S = 0.02
PROMPT = "w1 w2 w3"
#: 14a: about 14 s paced, many polls and share writes long.
PROGRESS_TOKENS = 600
#: 14b: each of the first two runs about 14 s while the third waits.
MATCH_TOKENS = 600
#: 14c: rank 0's generation, about 55 s paced: longer than the hold and the return (about
#: 10-25 s). One stream only: the API server carrying it accepts fewer connections while it
#: streams, so the other answers most reads (each one's view is read when it answers).
KEEPER_TOKENS = 2400
#: 14c: the requests rank 1 holds (they complete once it steps again).
HELD_TOKENS = 64
#: 14c: at most this many requests pinned to rank 1 until each API server holds one.
HELD_REQUESTS_MAX = 12
#: Generous liveness bounds (the expected times are seconds: docs/e2e.md).
SERIES_WAIT_S = 60.0
STALLED_WITHIN_S = STALL_AFTER_S + 60.0
BACK_WITHIN_S = 60.0
STATUS_SAMPLE_S = 0.25
#: Reads of a route in a row (both API servers answer some of them).
READS = 6


# -- helpers -------------------------------------------------------------------------------------


def engine(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [e for e in doc["engines"] if str(e["engine"]) == name]
    assert len(found) == 1, (name, doc["engines"])
    return found[0]


def progress_series(endpoint: Endpoint) -> dict[str, float]:
    """Rank → ``vllm_dp_engine_progress_tokens_total`` (summed over both API servers)."""
    scrape = endpoint.scrape()
    found = {}
    for e in ENGINES:
        value = scrape.value("vllm_dp_engine_progress_tokens_total", engine=e)
        assert value is not None, f"no progress series for rank {e}"
        found[e] = value
    return found


def steady_progress(endpoint: Endpoint) -> dict[str, float]:
    """The progress series once two reads 1.5 s apart agree (earlier tokens all shared)."""

    def steady() -> dict[str, float] | None:
        first = progress_series(endpoint)
        time.sleep(1.5)
        return first if progress_series(endpoint) == first else None

    return web.wait_for(steady, SERIES_WAIT_S, "the progress series steady")


def vllm_counters(endpoint: Endpoint) -> dict[str, float]:
    """Rank → vLLM's own ``vllm:prompt_tokens_total`` + ``vllm:generation_tokens_total``
    (multiprocess counters: summed over the API servers by vLLM's collector)."""
    scrape = endpoint.scrape()
    return {
        e: scrape.total("vllm:prompt_tokens_total", engine=e)
        + scrape.total("vllm:generation_tokens_total", engine=e)
        for e in ENGINES
    }


Pair = tuple[Any, Any]


def counts_everywhere(endpoint: Endpoint) -> dict[str, dict[str, Pair]]:
    """Per source, rank → (running, waiting): vLLM's own gauges and the exporter's series (one
    scrape), the exporter's ``/dp/status`` activity (the read right before it)."""
    doc = endpoint.status()
    scrape = endpoint.scrape()

    def vllm(e: str) -> Pair:
        return (
            scrape.value("vllm:num_requests_running", engine=e),
            scrape.value("vllm:num_requests_waiting", engine=e),
        )

    def series(e: str) -> Pair:
        return (
            scrape.value("vllm_dp_engine_requests", engine=e, state="running"),
            scrape.value("vllm_dp_engine_requests", engine=e, state="waiting"),
        )

    def status(e: str) -> Pair:
        activity = engine(doc, e)["activity"]
        return activity["running"], activity["waiting"]

    return {
        "vllm": {e: vllm(e) for e in ENGINES},
        "series": {e: series(e) for e in ENGINES},
        "status": {e: status(e) for e in ENGINES},
    }


def agree(counts: dict[str, dict[str, Pair]]) -> bool:
    """vLLM's gauges, the series and /dp/status give the same numbers for every rank."""
    for e in ENGINES:
        vllm = counts["vllm"][e]
        if None in vllm:
            return False
        as_int = (int(vllm[0]), int(vllm[1]))
        series = counts["series"][e]
        if series != vllm or counts["status"][e] != as_int:
            return False
    return True


@dataclass(frozen=True)
class Read:
    """One ``/dp/status`` read: when it was sent (monotonic), which API server answered, its
    last poll (number, role, the leader's reading's age), and every rank's state, routability
    and progress."""

    at: float
    server: str
    poll: str
    ranks: dict[str, dict[str, Any]]


@dataclass
class StatusLog(Sampler):
    """``/dp/status`` read every ``STATUS_SAMPLE_S`` on a thread (a ``with`` block)."""

    endpoint: Endpoint
    samples: list[Read] = field(default_factory=list)
    #: Reads that failed (a gap in the diagnostics, never the test's verdict).
    failed: list[str] = field(default_factory=list)

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                doc = self.endpoint.status()
                last = doc["last_poll"]
                source = last.get("source") or {}
                poll = f"poll {last['number']} {source.get('role')} {source.get('age_s')}"
                ranks = {
                    str(e["engine"]): {
                        "state": e["state"],
                        "routable": e["routable"],
                        "progress": e["progress"],
                        "activity": e["activity"],
                    }
                    for e in doc["engines"]
                }
                self.samples.append(Read(sent, server_of(doc), poll, ranks))
            except Exception as exc:  # any failed read is only a gap in the diagnostics
                self.failed.append(f"{type(exc).__name__}: {exc}"[:200])
            self._stop.wait(STATUS_SAMPLE_S)

    def between(self, start: float, end: float = float("inf")) -> list[Read]:
        return [r for r in list(self.samples) if start <= r.at <= end]

    def timeline(self, start: float) -> str:
        """Per API server, the reads (from ``start``) where a rank's state or reasons changed:
        ``client 1 +2.3s 0=awake 1=stalled(stalled: holds ...) [poll 12 follower 0.4]``."""

        def brief(rank: dict[str, Any]) -> str:
            reasons = rank["routable"]["reasons"]
            return str(rank["state"]) + (f"({'; '.join(reasons)})" if reasons else "")

        last: dict[str, str] = {}
        lines = []
        for read in self.between(start):
            now = " ".join(f"{e}={brief(read.ranks[e])}" for e in ENGINES)
            if last.get(read.server) != now:
                who = read.server.removeprefix("in-process (vLLM ").removesuffix(")")
                lines.append(f"{who} +{read.at - start:.1f}s {now} [{read.poll}]")
                last[read.server] = now
        return "; ".join(lines)


def hold_requests_in_every_api_server(
    endpoint: Endpoint, api_url: str, rank: str
) -> tuple[list[LongGeneration], dict[str, int]]:
    """Streamed requests pinned to ``rank``, sent one at a time until each API server holds
    at least one (a connection reaches whichever API server accepts it first): after each,
    every server's own count of its unfinished requests on the rank (``progress.held`` in its
    ``/dp/status``), read after the send, must add up to the requests sent. The server carrying
    rank 0's stream answers few reads (``KEEPER_TOKENS``): the wait is the long one."""
    gens: list[LongGeneration] = []
    held: dict[str, int] = {}
    last: dict[str, Any] = {}  # per API server: what its last read said (diagnostics)
    for i in range(HELD_REQUESTS_MAX):
        prompt = f"w{i + 20} w{i + 21}"
        gens.append(LongGeneration(api_url, prompt, HELD_TOKENS, headers=pinned(rank)))
        held.clear()  # read again after this send
        last.clear()

        def counted() -> bool:
            doc = endpoint.status()
            read = engine(doc, rank)
            held[server_of(doc)] = read["progress"]["held"]
            last[server_of(doc)] = {
                "poll": doc["last_poll"]["number"],
                "progress": read["progress"],
                "activity": read["activity"],
            }
            return len(held) == len(API_SERVERS) and sum(held.values()) == len(gens)

        try:
            web.wait_for(
                counted, SERIES_WAIT_S, f"{len(gens)} requests counted on rank {rank}", 0.1
            )
        except AssertionError as exc:
            sent = "; ".join(gen.timeline(gen.sent_at) for gen in gens)
            raise AssertionError(f"{exc}: last read per API server {last}; sent: {sent}") from exc
        if all(n >= 1 for n in held.values()):
            return gens, held
    raise AssertionError(f"{HELD_REQUESTS_MAX} requests all reached one API server: {held}")


# -- the deployment ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-hold")


@pytest.fixture(scope="module")
def served(
    runtime: VllmRuntime,
    procs: ProcessGroup,
    tmp_path_factory: pytest.TempPathFactory,
    hold_dir: Path,
) -> PluginServer:
    """``vllm serve`` with 2 DP engines and 2 API servers, the plugin, ``--stall-after`` 8 s,
    the engine hook on ``PYTHONPATH`` (paced from the start, holding nothing)."""
    assert plugin_install.install(runtime.version).venv == runtime.venv
    for rank in ENGINES:
        Path(hook.pace_file(hold_dir, int(rank))).write_text(str(PACE_S))
    token_file, token = write_token(tmp_path_factory.mktemp("progress-token"))
    return start_plugin_server(
        runtime,
        procs,
        token_file,
        token,
        settings={"STALL_AFTER": str(STALL_AFTER_S), "POLL_INTERVAL": str(POLL_S)},
        extra_env={"PYTHONPATH": str(HOOK_DIR), hook.HOLD_DIR_ENV: str(hold_dir)},
        extra_args=cli_flags(max_num_seqs=MAX_NUM_SEQS),
        name="vllm-serve-progress",
    )


# Run in vLLM's Python with the hook folder on PYTHONPATH: is EngineCore.step wrapped?
HOOK_PROBE = """
import json, vllm.v1.engine.core as core
print(json.dumps({n: bool(getattr(getattr(core.EngineCore, n), "__e2e_hold__", False))
                  for n in ("step", "step_with_batch_queue")}))
"""


def test_scenario14_the_hook_is_in_each_engine_core_and_inert_without_its_variable(
    served: PluginServer, runtime: VllmRuntime, tmp_path: Path
) -> None:
    """The hook patched ``vllm.v1.engine.core`` in both engine-core processes of the
    deployment (their own log lines); in vLLM's Python with the folder on ``PYTHONPATH`` it
    wraps ``EngineCore.step`` only when ``VLLM_DP_E2E_HOLD_DIR`` is set."""
    lines = served.server.log_text().splitlines()
    pids = engine_core_pids(served.server)
    assert sorted(pids) == [0, 1], pids
    for rank, pid in sorted(pids.items()):
        patched = f"e2e engine hook: {hook.TARGET} patched"
        assert any(patched in line and f"(pid {pid})" in line for line in lines), (rank, pid)
    answers: dict[bool, Any] = {}
    for variable in (None, str(tmp_path)):
        env = {k: v for k, v in runtime.env().items() if k != hook.HOLD_DIR_ENV}
        env["PYTHONPATH"] = str(HOOK_DIR)
        if variable is not None:
            env[hook.HOLD_DIR_ENV] = variable
        out = subprocess.run(
            [str(runtime.venv / "bin" / "python"), "-c", HOOK_PROBE],
            capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path, env=env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        answers[variable is not None] = json.loads(out.stdout.splitlines()[-1])
    assert answers == {
        False: {"step": False, "step_with_batch_queue": False},
        True: {"step": True, "step_with_batch_queue": True},
    }


def test_scenario14a_progress_grows_on_the_generating_rank_only(served: PluginServer) -> None:
    """A streamed generation pinned to rank 0: its progress series grows while it streams,
    rank 1's stays; afterwards rank 0 grew by exactly what vLLM's own counters of engine 0
    grew (prompt plus generated), rank 1 by nothing."""
    endpoint, api = served.endpoint, served.api_url
    doc = endpoint.status()
    assert [engine(doc, e)["progress"]["source"] for e in ENGINES] == ["stat_logger"] * 2, doc
    before = steady_progress(endpoint)
    vllm_before = vllm_counters(endpoint)
    gen = LongGeneration(api, PROMPT, PROGRESS_TOKENS, headers=pinned("0"))
    samples: list[tuple[float, dict[str, float]]] = []
    while not gen.finished.wait(0.5):
        samples.append((time.monotonic() - gen.sent_at, progress_series(endpoint)))
        assert time.monotonic() - gen.sent_at < 300, "the generation is still streaming"
    assert gen.result(0) == PROGRESS_TOKENS
    timeline = ", ".join(f"+{t:.1f}s {v['0']:.0f}/{v['1']:.0f}" for t, v in samples)
    # Grown while it streamed (not only once at its end): two values above the start at least.
    grown = sorted({v["0"] for _, v in samples if v["0"] > before["0"]})
    assert len(grown) >= 2, f"rank 0's series during the stream: {timeline}"
    assert all(v["1"] == before["1"] for _, v in samples), timeline

    def vllm_counted() -> dict[str, float] | None:
        grew = {e: n - vllm_before[e] for e, n in vllm_counters(endpoint).items()}
        return grew if grew["0"] >= PROGRESS_TOKENS else None

    vllm_grew = web.wait_for(vllm_counted, SERIES_WAIT_S, "vLLM's own counters of engine 0")

    def progress_counted() -> dict[str, float] | None:
        now = progress_series(endpoint)
        return now if now["0"] - before["0"] >= vllm_grew["0"] else None

    after = web.wait_for(progress_counted, SERIES_WAIT_S, "rank 0's series to take every token")
    assert vllm_grew["1"] == 0, vllm_grew
    assert after["0"] - before["0"] == vllm_grew["0"], (before, after, vllm_grew)
    assert after["1"] == before["1"], (before, after)
    print(
        f"\nscenario 14a: rank 0 {before['0']:.0f} -> {after['0']:.0f} (+{vllm_grew['0']:.0f}, "
        f"vLLM's own prompt+generation of engine 0 alike), rank 1 {before['1']:.0f} throughout;"
        f" stream {gen.timeline(gen.sent_at)}; series while streaming (rank 0/rank 1): {timeline}"
    )


def test_scenario14b_running_and_waiting_match_vllms_own_gauges(served: PluginServer) -> None:
    """Rank 0 runs two generations and queues a third (``--max-num-seqs 2``), rank 1 runs one:
    one read where, for both engine labels, vLLM's own ``vllm:num_requests_running`` /
    ``_waiting``, the exporter's ``vllm_dp_engine_requests`` and ``/dp/status`` agree (rank 0
    running 2 waiting 1, rank 1 running 1 waiting 0); all 0 on every side once they ended."""
    endpoint, api = served.endpoint, served.api_url
    gens = [
        LongGeneration(api, f"w{i} w9", MATCH_TOKENS, headers=pinned("0"))
        for i in range(MAX_NUM_SEQS + 1)
    ]
    gens.append(LongGeneration(api, "w8 w9", MATCH_TOKENS, headers=pinned("1")))
    seen: list[str] = []

    def busy_and_agreeing() -> dict[str, dict[str, Pair]] | None:
        counts = counts_everywhere(endpoint)
        seen.append(json.dumps(counts))
        vllm = counts["vllm"]
        busy = vllm["0"][1] is not None and vllm["0"][1] >= 1 and (vllm["1"][0] or 0) >= 1
        return counts if busy and agree(counts) else None

    try:
        counts = web.wait_for(
            busy_and_agreeing,
            SERIES_WAIT_S,
            "vLLM's gauges, the series and /dp/status agreeing while both ranks run",
            interval_s=0.2,
            abort=lambda: first_exited(served.server),
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the reads: {seen[-10:]}") from exc
    assert counts["status"] == {"0": (MAX_NUM_SEQS, 1), "1": (1, 0)}, counts
    print(f"\nscenario 14b: while running, read {len(seen)} (status, scrape) pairs: {counts}")
    for gen in gens:
        assert gen.result(300) == MATCH_TOKENS

    def all_idle() -> dict[str, dict[str, Pair]] | None:
        counts = counts_everywhere(endpoint)
        idle = all(p == (0, 0) for p in counts["status"].values())
        return counts if idle and agree(counts) else None

    idle = web.wait_for(all_idle, SERIES_WAIT_S, "every count 0 on every side")
    print(f"scenario 14b: after: {idle}")


def test_scenario14c_a_rank_holding_requests_without_stepping_reads_stalled(
    served: PluginServer, hold_dir: Path
) -> None:
    """Rank 0 keeps generating (one long generation, no new request on it meanwhile); rank 1
    is held (the hook) and requests are pinned to it until each API server holds one. Every
    API server then reads rank 1 ``stalled`` (answering calls, ``has_work`` true, its requests
    counted) and leaves it out of ``/dp/routable`` and ``/dp/readyz``, as the series say;
    rank 0 is never stalled in any read. Released, rank 1 completes them and both ranks read
    awake and routable in every API server."""
    endpoint, api = served.endpoint, served.api_url
    hold = Path(hook.hold_file(hold_dir, 1))
    timings: dict[str, float] = {}
    with StatusLog(endpoint) as log:
        keepers = [LongGeneration(api, "w0 w3 w4", KEEPER_TOKENS, headers=pinned("0"))]
        for gen in keepers:
            assert gen.started.wait(120) and gen.error is None, gen.timeline(gen.sent_at)
        before = progress_series(endpoint)
        web.wait_for(
            lambda: progress_series(endpoint)["0"] > before["0"],
            SERIES_WAIT_S,
            "rank 0's progress growing",
        )
        time.sleep(2 * POLL_S)  # every API server's last poll saw rank 0's progress
        window = time.monotonic()
        start = progress_series(endpoint)

        hold.touch()
        held_at = time.monotonic()
        held: list[LongGeneration] = []
        try:
            held, held_by = hold_requests_in_every_api_server(endpoint, api, "1")
            first_sent = held[0].sent_at
            stalled_in: dict[str, tuple[float, dict[str, Any]]] = {}

            def stalled_everywhere() -> bool:
                doc = endpoint.status()
                rank1 = engine(doc, "1")
                if rank1["state"] == "stalled" and engine(doc, "0")["routable"]["routable"]:
                    stalled_in.setdefault(server_of(doc), (time.monotonic() - first_sent, doc))
                return len(stalled_in) == len(API_SERVERS)

            web.wait_for(
                stalled_everywhere,
                STALLED_WITHIN_S,
                f"rank 1 stalled in every API server (seen in {sorted(stalled_in)})",
                interval_s=0.1,
                abort=lambda: first_exited(served.server),
            )
            timings.update({f"stalled in {s}": t for s, (t, _) in stalled_in.items()})
            # The stall clock starts when the rank got the work (no earlier than the first
            # held request was sent), never at its last token before: an idle rank's new
            # request is not stalled at once.
            early = {s: t for s, (t, _) in stalled_in.items() if t < STALL_AFTER_S}
            assert not early, f"stalled sooner than --stall-after after the work came: {early}"
            first_reasons = {
                s: engine(doc, "1")["routable"]["reasons"] for s, (_, doc) in stalled_in.items()
            }
            for _, doc in stalled_in.values():
                rank1, rank0 = engine(doc, "1"), engine(doc, "0")
                assert rank1["routable"]["routable"] is False, rank1
                (reason,) = rank1["routable"]["reasons"]
                assert reason.startswith("stalled: holds requests, no token computed for "), rank1
                # Not hung and not paused: it answers every call, and says it has work.
                assert rank1["unresponsive_seconds"] == 0, rank1
                assert rank1["invariants"]["is_sleeping"]["outcome"] == "ok", rank1
                assert rank1["invariants"]["is_scheduler_paused"]["value"] is False, rank1
                activity, own = rank1["activity"], rank1["progress"]["held"]
                assert activity["has_work"] is True and activity["drained"] is False, rank1
                assert own >= 1 and activity["running"] + activity["waiting"] >= own, rank1
                assert rank0["state"] == "awake" and rank0["routable"]["routable"], rank0
            # Every held request counted, waiting (the hold came first: none was scheduled).
            web.wait_for(
                lambda: engine(endpoint.status(), "1")["activity"]["waiting"] == len(held),
                SERIES_WAIT_S,
                f"rank 1 waiting {len(held)}",
            )
            # Several reads in a row (both API servers answer some): still stalled, not routable.
            for _ in range(READS):
                routes = web.get(f"{api}/dp/routable").json()
                assert routes["routable_engines"] == ["0"], routes
                reasons = {str(e["engine"]): e["reasons"] for e in routes["engines"]}
                assert [r.split(" for ")[0] for r in reasons["1"]] == [
                    "stalled: holds requests, no token computed"
                ], routes
                ready = web.get(f"{api}/dp/readyz?engine=1")
                assert ready.status == 503, ready
                assert ready.json()["reasons"][0].startswith("stalled:"), ready.json()
                time.sleep(0.2)

            def stalled_series() -> web.Scrape | None:
                scrape = endpoint.scrape()
                stalled = scrape.value("vllm_dp_engine_state", engine="1", state="stalled")
                return scrape if stalled == 1 else None

            scrape = web.wait_for(
                stalled_series, SERIES_WAIT_S, "vllm_dp_engine_state{engine=1,state=stalled} 1"
            )
            assert scrape.value("vllm_dp_engine_routable", engine="1") == 0
            assert scrape.value("vllm_dp_engine_state", engine="0", state="stalled") == 0
            assert scrape.value("vllm_dp_engine_routable", engine="0") == 1
            assert [g.first_token_at for g in held] == [None] * len(held), "a held one streamed"
            during = progress_series(endpoint)
            assert during["1"] == start["1"], (start, during)
            assert during["0"] > start["0"], (start, during)
            vllm_rank1 = (
                scrape.value("vllm:num_requests_running", engine="1"),
                scrape.value("vllm:num_requests_waiting", engine="1"),
            )
            exporter_rank1 = (
                scrape.value("vllm_dp_engine_requests", engine="1", state="running"),
                scrape.value("vllm_dp_engine_requests", engine="1", state="waiting"),
            )
            assert all(not g.finished.is_set() for g in keepers), "rank 0 stopped generating"
        finally:
            hold.unlink(missing_ok=True)
            released = time.monotonic()
        for gen in held:
            assert gen.result(120) == HELD_TOKENS
        timings["held requests done"] = max(g.finished_at or 0.0 for g in held) - released
        back_in: dict[str, float] = {}
        #: Per API server, its reads still showing rank 1 not back (a slow return's story).
        not_back: dict[str, list[str]] = {}
        #: Per API server, when it first answered a read after the release.
        answered: dict[str, float] = {}

        def back_everywhere() -> bool:
            doc = endpoint.status()
            answered.setdefault(server_of(doc), time.monotonic() - released)
            ranks = [engine(doc, e) for e in ENGINES]
            if all(r["state"] == "awake" and r["routable"]["routable"] for r in ranks):
                back_in.setdefault(server_of(doc), time.monotonic() - released)
            elif server_of(doc) not in back_in:
                rank1, last = ranks[1], doc["last_poll"]
                not_back.setdefault(server_of(doc), []).append(
                    f"+{time.monotonic() - released:.1f}s poll {last['number']} "
                    f"{last['source']} 1={rank1['state']} {rank1['activity']} "
                    f"{rank1['progress']}"
                )
            return len(back_in) == len(API_SERVERS)

        try:
            web.wait_for(
                back_everywhere,
                BACK_WITHIN_S,
                f"both ranks awake and routable in every API server (seen in {sorted(back_in)})",
                interval_s=0.1,
                abort=lambda: first_exited(served.server),
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; since the release: {log.timeline(released)}") from exc
        timings.update({f"normal in {s}": t for s, t in back_in.items()})
        timings.update({f"first read of {s} after the release": t for s, t in answered.items()})
        slow = {s: reads[-3:] for s, reads in not_back.items() if back_in[s] > 2 * STALL_AFTER_S}
        for _ in range(READS):
            assert web.get(f"{api}/dp/routable").json()["routable_engines"] == list(ENGINES)
            assert web.get(f"{api}/dp/readyz?engine=1").status == 200
            time.sleep(0.2)

        def normal_series() -> bool:
            scrape = endpoint.scrape()
            stalled = scrape.value("vllm_dp_engine_state", engine="1", state="stalled")
            return stalled == 0 and scrape.value("vllm_dp_engine_routable", engine="1") == 1

        web.wait_for(normal_series, SERIES_WAIT_S, "rank 1 not stalled, routable on /metrics")
        window_end = time.monotonic()
        for gen in keepers:
            assert gen.result(300) == KEEPER_TOKENS

    # Rank 0 generated all along and never read stalled, in any read of either API server.
    samples = log.between(window, window_end)
    servers = {read.server for read in samples}
    assert servers == set(API_SERVERS), servers
    wrong = [
        (round(read.at - window, 2), read.server, read.ranks["0"])
        for read in samples
        if read.ranks["0"]["state"] == "stalled"
        or any(str(r).startswith("stalled:") for r in read.ranks["0"]["routable"]["reasons"])
    ]
    assert not wrong, wrong
    other = sorted({r for read in samples for r in read.ranks["0"]["routable"]["reasons"]})
    text = served.server.log_text()
    assert "e2e engine hook: rank 1 holds its requests" in text
    assert "e2e engine hook: rank 1 steps again" in text
    print(
        f"\nscenario 14c: held {len(held)} requests ({held_by}); "
        + ", ".join(f"{k} +{v:.1f}s" for k, v in sorted(timings.items()))
        + f" (stalled: from the first held request, first reasons {first_reasons}; normal:"
        f" from the release); "
        f"while held, rank 1 running/waiting: vLLM's gauges {vllm_rank1}, the exporter's "
        f"{exporter_rank1}; rank 0 in {len(samples)} /dp/status reads over "
        f"{window_end - window:.0f}s: never stalled, other reasons {other or 'none'}; "
        f"{len(log.samples)} reads ({len(log.failed)} failed{': ' if log.failed else ''}"
        f"{log.failed[-1] if log.failed else ''}), changes seen since the hold: "
        f"{log.timeline(held_at)}" + (f"; slow to read normal again: {slow}" if slow else "")
    )


@pytest.fixture(autouse=True)
def _nothing_held(hold_dir: Path) -> Iterator[None]:
    """No test starts, or leaves the deployment, with a rank held."""
    for rank in ENGINES:
        Path(hook.hold_file(hold_dir, int(rank))).unlink(missing_ok=True)
    yield
    for rank in ENGINES:
        Path(hook.hold_file(hold_dir, int(rank))).unlink(missing_ok=True)
