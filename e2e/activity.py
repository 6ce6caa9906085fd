"""Busy and drained per rank (docs/e2e.md, scenario 12), the same in relay and
in-process mode: one long streamed generation on one rank, what the exporter says of each rank
while it runs and after (12a), and ``POST /admin/pause?mode=wait`` sent during it (12b).

vLLM runs the tiny dense model's DP ranks as independent ``EngineCoreProc``s (0.32:
``DPEngineCoreProc``, with its lock-step DP waves, is for MoE models only), so the rank without
a request answers ``has_work`` false all along and the busy one turns false as soon as its
request finished. What differs per mode is passed in: how the test learns which rank vLLM's load
balancer chose, and whether the exporter knows request counts (``counts_known``: both modes
read the DP coordinator's per-rank counts, in-process from the front end's load-balancing table,
relay from the coordinator's publication it follows; without them the counts must be null).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from e2e import web
from e2e.traffic import RANK_HEADER, LongGeneration, complete, start_long_generations

ENGINES = ("0", "1")
#: One streamed generation of this many tokens (``ignore_eos``): 6.6 s on its engine on this
#: idle machine (3,000 took 11-17 s at load average 4), several polls (every second) long, and
#: short enough that a pause waiting for it answers well within the exporter's 60 s action
#: timeout on a loaded machine.
ACTIVITY_TOKENS = 2000
#: Scenario 12a's generation: twice as long (about 13 s on this idle machine; the model's
#: context is 4,096), so the status, gate and series checks all fall inside it even when
#: the rank shows busy only a few polls after the first token (seen in CI: 2,000 tokens ended
#: between the status check and the gate).
LONG_ACTIVITY_TOKENS = 4000
#: How long the drained gate may take to answer 200 once the generation's stream ended.
DRAIN_WAIT_S = 60.0
#: How long the exporter may take to show the generation's rank busy (its poll: every second).
SEEN_WAIT_S = 20.0
#: Generations scenario 12a may start before its gate catches one still on its engine.
GATE_ATTEMPTS = 3
#: How long a pinned generation's first token may take (a loaded front end is slow).
FIRST_TOKEN_S = 120.0
#: How much later than the pause's answer the stream may end: vLLM's front end still streams
#: the last chunk the engine sent before its pause completed.
STREAM_LAG_S = 2.0
#: How often the sampler reads /status.
SAMPLE_INTERVAL_S = 0.25
#: GET /gate answers from a fan-out at most this old (the exporter's --gate-min-interval).
GATE_MIN_INTERVAL_S = 0.2


class Exporter(Protocol):
    """An exporter's HTTP surface as both modes' handles offer it (``ExporterProc`` in relay
    mode, ``inprocess.Endpoint`` for the plugin's ``/dp/...`` routes)."""

    def status(self) -> dict[str, Any]: ...

    def scrape(self) -> web.Scrape: ...

    def gate(self, **conditions: str) -> web.Reply: ...

    def admin(self, action: str, payload: Any = None, **query: str) -> web.Reply: ...


def activities(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Engine → its ``activity`` object of one ``/status`` document."""
    return {str(e["engine"]): e["activity"] for e in status["engines"]}


def brief(activity: dict[str, Any]) -> str:
    """``work r1 w0`` / ``idle r- w-``: one rank's activity in a few characters."""
    work = {True: "work", False: "idle", None: "?"}[activity["has_work"]]

    def count(key: str) -> str:
        return "-" if activity[key] is None else str(activity[key])

    return f"{work} r{count('running')} w{count('waiting')}"


_Sampler = TypeVar("_Sampler", bound="Sampler")


@dataclass
class Sampler:
    """A ``with`` block running ``_run`` on a daemon thread until the block ends (``_run``
    loops until ``_stop`` is set); the thread is waited for at most 30 s."""

    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)

    def __enter__(self: _Sampler) -> _Sampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        raise NotImplementedError


@dataclass
class ActivityLog(Sampler):
    """``/status`` read every ``SAMPLE_INTERVAL_S`` on a thread (a ``with`` block): every
    rank's activity over time, for the timeline a report and a failure print."""

    status: Callable[[], dict[str, Any]]
    since: float = field(default_factory=time.monotonic)
    samples: list[tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=list)

    def _run(self) -> None:
        while not self._stop.is_set():
            # A failed read is a gap in the diagnostics, never the test's verdict.
            with contextlib.suppress(OSError, AssertionError, KeyError, ValueError):
                self.samples.append((time.monotonic(), activities(self.status())))
            self._stop.wait(SAMPLE_INTERVAL_S)

    def first(self, engine: str, key: str, value: Any, after: float = 0.0) -> float:
        """When a sample (from ``after`` on) first had ``activity[key] == value`` for
        ``engine`` (monotonic; infinity when none had)."""
        for at, acts in list(self.samples):
            if at >= after and engine in acts and acts[engine][key] == value:
                return at
        return float("inf")

    def gaps(self) -> str:
        """How many samples were read, and the longest wait between two (a slow ``/status``)."""
        times = [at for at, _ in list(self.samples)]
        longest = max((b - a for a, b in itertools.pairwise(times)), default=0.0)
        return f"{len(times)} samples, longest gap {longest:.2f}s"

    def timeline(self) -> str:
        """The samples where anything changed: ``+1.25s 0=work r- w- 1=idle r- w-``."""
        lines, last = [], None
        for at, acts in list(self.samples):
            now = " ".join(f"{e}={brief(a)}" for e, a in sorted(acts.items()))
            if now != last:
                lines.append(f"+{at - self.since:.2f}s {now}")
                last = now
        return "; ".join(lines)


def wait_gate_drained(exporter: Exporter, timeout_s: float = DRAIN_WAIT_S) -> float:
    """Until ``GET /gate?drained=true`` answers 200; returns the seconds it took."""
    started = time.monotonic()
    web.wait_for(
        lambda: exporter.gate(drained="true").status == 200,
        timeout_s,
        "/gate?drained=true to answer 200",
        interval_s=0.1,
    )
    return time.monotonic() - started


def other(engine: str) -> str:
    return ENGINES[1 - ENGINES.index(engine)]


def _counts(activity: dict[str, Any]) -> tuple[Any, Any]:
    return activity["running"], activity["waiting"]


def _busy_activities(acts: dict[str, dict[str, Any]], busy: str, counts_known: bool) -> bool:
    """Whether one /status read shows ``busy`` with work (with counts: running) and the
    other rank drained."""
    a, b = acts[busy], acts[other(busy)]
    if a["has_work"] is not True or b["has_work"] is not False:
        return False
    return not counts_known or (isinstance(a["running"], int) and a["running"] >= 1)


def _series_show(exporter: Exporter, busy: str, counts_known: bool) -> web.Scrape | None:
    scrape = exporter.scrape()
    work = {e: scrape.value("vllm_dp_engine_has_work", engine=e) for e in ENGINES}
    if work != {busy: 1.0, other(busy): 0.0}:
        return None
    if counts_known:
        running = scrape.value("vllm_dp_engine_requests", engine=busy, state="running")
        if running is None or running < 1:
            return None
    return scrape


@dataclass
class WorkSeen:
    """What scenario 12a saw, for its report line."""

    busy: str
    #: From sending the request to the first /status sample showing the busy rank's work.
    seen_after_s: float
    gate_body: dict[str, Any]
    generation: LongGeneration
    drained_after_s: float
    final: dict[str, dict[str, Any]]


def pinned(rank: str) -> dict[str, str]:
    """The request headers that pin a generation to DP rank ``rank`` (docs/routing.md)."""
    return {RANK_HEADER: rank}


def _gate_naming(exporter: Exporter, busy: str, gen: LongGeneration) -> dict[str, Any] | None:
    """The first ``/gate?drained=true`` answer that is 412 (its body), asked again and again
    from the request on while the generation's stream has not ended (bounded: ``SEEN_WAIT_S``
    past its first token, which a loaded front end streams late); None when every answer
    before its end was 200 (the engine had finished), or the stream ended first."""
    deadline = time.monotonic() + FIRST_TOKEN_S
    while time.monotonic() < deadline and not gen.finished.is_set():
        if gen.first_token_at is not None:
            deadline = min(deadline, gen.first_token_at + SEEN_WAIT_S)
        reply = exporter.gate(drained="true")
        if reply.status == 412:
            body: dict[str, Any] = reply.json()
            return body
        assert reply.status == 200, (reply.status, reply.json())
        time.sleep(GATE_MIN_INTERVAL_S + 0.1)  # past the last fan-out: the next one is fresh
    return None


def generation_is_work_then_drains(
    exporter: Exporter,
    api_url: str,
    busy_rank: Callable[[], str | None],
    *,
    counts_known: bool,
    log: ActivityLog,
    before_generation: Callable[[], None] | None = None,
) -> WorkSeen:
    """Scenario 12a: the fleet drained first; one long generation pinned to a rank
    (``X-data-parallel-rank``, each attempt the other rank). While it runs on its engine:
    ``/gate?drained=true`` 412 naming that rank alone (asked until it does: the gate's fresh
    fan-out, not the polls, races the engine's end), ``vllm_dp_engine_has_work`` 1 and 0, and a
    ``/status`` read (sampled by ``log``) shows that rank with work (with ``counts_known``,
    ``running`` ≥ 1) and the other drained; ``busy_rank`` names the rank ``/status`` shows
    busy (none before each attempt). After its stream ended: the gate 200 within
    ``DRAIN_WAIT_S``, both ranks drained in ``/status``. Under load the engine computes the
    4,000 tokens in 7 s while vLLM's front end streams them for 20 (seen here: the first chunk
    came with all of them): a gate that never named the rank before the engine finished is one
    attempt of ``GATE_ATTEMPTS``, printed, and so is one whose work no poll's series showed;
    ``before_generation`` runs before each generation."""
    missed: list[str] = []
    for attempt in range(GATE_ATTEMPTS):
        busy = ENGINES[(attempt + 1) % len(ENGINES)]
        wait_gate_drained(exporter)
        # /status must have caught up too (an earlier attempt's rank is no answer to this one).
        web.wait_for(lambda: busy_rank() is None, SEEN_WAIT_S, "/status without a busy rank")
        # A gate answered within GATE_MIN_INTERVAL_S of the drained check above shares that
        # check's fan-out (taken before the request): wait it out.
        time.sleep(GATE_MIN_INTERVAL_S + 0.1)
        if before_generation is not None:
            before_generation()
        gen = LongGeneration(api_url, "w0 w1 w2", LONG_ACTIVITY_TOKENS, headers=pinned(busy))
        sent = gen.sent_at
        body = _gate_naming(exporter, busy, gen)
        if body is None:  # every gate found the rank drained: the engine had finished
            missed.append(
                f"attempt {len(missed) + 1}: no gate named rank {busy} before it finished "
                f"(+{time.monotonic() - sent:.1f}s); the generation: {gen.timeline(sent)}; "
                f"{log.timeline()} ({log.gaps()})"
            )
            print(f"scenario 12a: the gate came after the engine's end, {missed[-1]}")
            gen.result(300)
            continue
        # The series of one poll: 1 for the busy rank can only come from a poll that saw its
        # work. The last poll's now, else one of the next ones; none showing it before the
        # engine finished is one attempt, printed.
        shown = f"vllm_dp_engine_has_work 1 for rank {busy}, 0 for rank {other(busy)}"
        series = functools.partial(_series_show, exporter, busy, counts_known)
        try:
            scrape = series() or web.wait_for(series, SEEN_WAIT_S, shown)
        except AssertionError as exc:
            missed.append(
                f"attempt {len(missed) + 1}: the gate said rank {busy} has work "
                f"+{time.monotonic() - sent:.1f}s, but {exc}; the generation: "
                f"{gen.timeline(sent)}; {log.timeline()} ({log.gaps()})"
            )
            print(f"scenario 12a: the series never showed the work, {missed[-1]}")
            gen.result(300)
            continue
        break
    else:
        raise AssertionError("; ".join(missed))
    assert body["failing_engines"] == [busy], body
    entries = {str(e["engine"]): e for e in body["engines"]}
    assert entries[other(busy)]["ok"] is True, body
    assert entries[other(busy)]["values"]["drained"] is True, body
    (failure,) = entries[busy]["failures"]
    requests = entries[busy]["requests"]
    if counts_known:
        # The gate may catch the request before its first step: waiting, not yet running.
        assert requests is not None and requests["running"] + requests["waiting"] >= 1, body
        running, waiting = requests["running"], requests["waiting"]
        # Either vLLM's has_work said so, or it said false while the counts vLLM published
        # still held the request (the two are read at slightly different times): not drained.
        assert failure in (
            f"drained: has work (running {running}, waiting {waiting}), expected drained=true",
            f"drained: has_work false but requests published (running {running}, "
            f"waiting {waiting}), expected drained=true",
        ), body
    else:
        assert requests is None, body
        assert failure == "drained: has work, expected drained=true", body

    if not counts_known:
        assert scrape.find("vllm_dp_engine_requests") == [], "no counts: no series"

    assert gen.result(300) == LONG_ACTIVITY_TOKENS
    # /status: the sampler read it all along the generation; one read showed the busy rank
    # with work and the other drained.
    during = [a for at, a in list(log.samples) if at >= sent]
    acts = next((a for a in during if _busy_activities(a, busy, counts_known)), None)
    assert acts is not None, f"no /status read showed rank {busy} busy: {log.timeline()}"
    idle = acts[other(busy)]
    assert idle["drained"] is True, acts
    assert acts[busy]["drained"] is False, acts
    if counts_known:
        assert _counts(idle) == (0, 0), acts
    else:  # a mode without counts says null, never a guessed 0
        assert _counts(idle) == _counts(acts[busy]) == (None, None), acts

    assert gen.finished_at is not None
    wait_gate_drained(exporter)
    drained_after = time.monotonic() - gen.finished_at

    def both_drained() -> dict[str, dict[str, Any]] | None:
        acts = activities(exporter.status())
        return acts if all(a["drained"] is True for a in acts.values()) else None

    final = web.wait_for(both_drained, SEEN_WAIT_S, "both ranks drained in /status")
    for activity in final.values():
        assert activity["has_work"] is False, final
        assert _counts(activity) == ((0, 0) if counts_known else (None, None)), final
    seen_after = log.first(busy, "has_work", True, after=sent) - sent
    return WorkSeen(busy, seen_after, body, gen, drained_after, final)


@dataclass
class PausedDrained:
    """What scenario 12b saw, for its report line."""

    body: dict[str, Any]
    generation: LongGeneration
    #: Seconds from sending the pause to its answer, and from the answer to the stream's end
    #: (negative: the stream had ended before the answer).
    pause_took_s: float
    stream_end_after_answer_s: float


def pause_wait_during_generation(exporter: Exporter, api_url: str) -> PausedDrained:
    """Scenario 12b: one long generation, ``POST /admin/pause?mode=wait`` once it streams.
    The answer comes only once the generation finished (its stream ends before the answer, or
    at most ``STREAM_LAG_S`` after: the front end's last chunk), with every token (a ``wait``
    pause aborts nothing); 200, every engine ok, the pause verified (paused and drained, read
    back). ``/gate?paused=true&drained=true`` 200. Then ``resume``, verified, and completions
    served again on a fleet that is awake and drained."""
    wait_gate_drained(exporter)
    (gen,) = start_long_generations(api_url, 1, ACTIVITY_TOKENS)
    assert not gen.finished.is_set()
    sent = time.monotonic()
    reply = exporter.admin("pause", mode="wait")
    answered = time.monotonic()
    body: dict[str, Any] = reply.json()
    try:
        assert reply.status == 200, body
        assert body["action"] == "pause" and body["outcome"] == "success", body
        assert body["verified"] is True and body["failed_engines"] == [], body
        assert body["params"] == {"mode": "wait"}, body
        assert [(str(e["engine"]), e["ok"], e["reason"], e["state"]) for e in body["engines"]] == [
            (e, True, None, True) for e in ENGINES
        ], body
        assert gen.finished.wait(STREAM_LAG_S), (
            f"the generation still streams {STREAM_LAG_S} s after the pause answered: "
            f"{gen.timeline(sent)}, answered +{answered - sent:.1f}s"
        )
        assert gen.result(0) == ACTIVITY_TOKENS and gen.finish_reason == "length"
        assert gen.finished_at is not None
        time.sleep(GATE_MIN_INTERVAL_S + 0.1)  # a fan-out from before the answer has expired
        paused = exporter.gate(paused="true", drained="true")
        assert paused.status == 200, paused.json()
    finally:
        resumed = exporter.admin("resume")
    resumed_body = resumed.json()
    assert resumed.status == 200, resumed_body
    assert resumed_body["verified"] is True, resumed_body
    assert [(str(e["engine"]), e["ok"], e["state"]) for e in resumed_body["engines"]] == [
        (e, True, False) for e in ENGINES
    ], resumed_body
    time.sleep(GATE_MIN_INTERVAL_S + 0.1)
    awake = exporter.gate(paused="false", sleeping="false", drained="true")
    assert awake.status == 200, awake.json()
    # Served again, by whichever rank vLLM's load balancer picks for each.
    for i in range(4):
        assert complete(api_url, f"w{i} w{i + 1}", 8)["usage"]["completion_tokens"] == 8
    return PausedDrained(body, gen, answered - sent, gen.finished_at - answered)
