"""Machine description and the Markdown report (docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from bench.flood import FLOOD_ENGINE, FloodResult
from bench.inprocess import SizeResult
from bench.profiling import Profile
from bench.service import AdminResult, FlapResult, RssResult, ServeCpuResult


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "exporter"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        return rev + (" (exporter/ has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_lines(event_loop: str = "auto") -> list[str]:
    import zmq

    from exporter.eventloop import resolve_event_loop

    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- Kernel: {platform.system()} {platform.release()}",
        f"- Python {platform.python_version()} ({sys.implementation.name})",
        f"- pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), msgspec {_version('msgspec')}, "
        f"prometheus-client {_version('prometheus-client')}, aiohttp {_version('aiohttp')}, "
        f"pyinstrument {_version('pyinstrument')}, uvloop {_version('uvloop')}",
        f"- event loop of the in-process tables (`--event-loop {event_loop}`): "
        f"{resolve_event_loop(event_loop)}; `serve` subprocesses: "
        f"{resolve_event_loop('auto')} (their default)",
        f"- git revision: {_git_revision()}",
        f"- load average at start (1/5/15 min): {load}",
    ]


@dataclass
class Report:
    command: str
    quick: bool
    machine: list[str]
    sizes: list[SizeResult] = field(default_factory=list)
    serve_cpu: ServeCpuResult | None = None
    admin: AdminResult | None = None
    rss: list[RssResult] = field(default_factory=list)
    flap: FlapResult | None = None
    flood: FloodResult | None = None
    errors: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    load_end: str = ""
    baseline: dict[str, float] | None = None
    baseline_source: str = ""


MARKER = "<!-- bench-results: "


def key_metrics(report: Report) -> dict[str, float]:
    """The headline numbers, embedded in the report so that a later run can compare."""
    m: dict[str, float] = {}
    for s in report.sizes:
        r = s.latency
        m[f"N={s.n} exporter is_sleeping p50 (ms)"] = r.exporter_p50 * 1e3
        m[f"N={s.n} exporter is_sleeping p99 (ms)"] = r.exporter_p99 * 1e3
        m[f"N={s.n} floor is_sleeping p50 (ms)"] = r.floor_p50 * 1e3
        m[f"N={s.n} exporter/floor p50 ratio"] = r.ratio_p50
        m[f"N={s.n} exporter CPU per call (µs)"] = r.exporter_cpu_per_call * 1e6
        if s.scrape is not None:
            m[f"N={s.n} /metrics render p50 (ms)"] = s.scrape.render_p50 * 1e3
            m[f"N={s.n} /metrics body (bytes)"] = float(s.scrape.body_bytes)
        if s.poll_cpu is not None:
            m[f"N={s.n} poll CPU per engine (µs)"] = s.poll_cpu.cpu_per_poll_engine * 1e6
    if report.serve_cpu is not None:
        c = report.serve_cpu
        m[f"N={c.n} serve CPU share at {c.poll_interval:g} s (%)"] = c.share * 100
    for rss in report.rss:
        m[f"N={rss.n} serve RSS (MiB)"] = rss.rss_kib / 1024
    if report.flap is not None and len(report.flap.points) >= 2:
        pts = report.flap.points
        m["flapping RSS growth (MiB)"] = (pts[-1][1] - pts[0][1]) / 1024
    if report.admin is not None:
        m[f"N={report.admin.n} admin reset p50 (ms)"] = report.admin.p50 * 1e3
        m[f"N={report.admin.n} admin reset p99 (ms)"] = report.admin.p99 * 1e3
    if report.flood is not None:
        fl = report.flood
        m["flood /metrics scrape p99 (ms)"] = fl.scrape_p99 * 1e3
        m["flood serve peak RSS (MiB)"] = fl.rss_peak_kib / 1024
    return {k: round(v, 4) for k, v in m.items()}


def read_baseline(path: Path) -> dict[str, float] | None:
    """The key metrics embedded in an earlier report (None when there are none)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start = text.rfind(MARKER)
    if start < 0:
        return None
    end = text.find(" -->", start)
    try:
        data = json.loads(text[start + len(MARKER) : end])
    except ValueError:
        return None
    return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else None


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _mib(kib: int) -> str:
    return f"{kib / 1024:.1f} MiB"


def _goal(ok: bool) -> str:
    return "met" if ok else "**not met**"


def render(report: Report) -> str:
    out: list[str] = ["# Benchmarks", ""]
    if report.quick:
        out += ["> **Quick run** (smoke configuration): numbers are not meaningful.", ""]
    out += [
        "Generated by `make bench` (`python -m bench.run`): simulated engines "
        "(`python -m exporter sim-engine`) run in separate processes, one process hosting many "
        "engines; the exporter side runs in the bench process (tables 1-3) or as a "
        "`python -m exporter serve` subprocess (tables 3b-6). All sockets are on 127.0.0.1.",
        "",
        "## Machine",
        "",
        *report.machine,
        f"- load average at end: {report.load_end}",
        f"- total bench time: {report.elapsed_s:.0f} s",
        "",
        "Other work may share the machine while the bench runs; the exporter and the floor "
        "are measured in alternating batches against fleets of the same shape, so the ratio is "
        "more trustworthy than the absolute numbers. The simulated engines are Python/asyncio "
        "and answer each call in tens of µs per engine; with N engines in one process their "
        "replies are serialised, which is a large part of the latency at high N for both sides.",
        "",
        "## Command",
        "",
        "```",
        report.command,
        "```",
        "",
    ]
    out += _comparison(report)
    out += _scale_goals(report)
    out += _latency_table(report)
    out += _tail_table(report)
    out += _scrape_table(report)
    out += _cpu_tables(report)
    out += _memory_table(report)
    out += _admin_table(report)
    out += _flood_table(report)
    out += _profile_section(report)
    if report.errors:
        out += ["## Errors", ""] + [f"- {e}" for e in report.errors] + [""]
    metrics = json.dumps(key_metrics(report), ensure_ascii=False)
    out += ["", f"{MARKER}{metrics} -->"]
    return "\n".join(out).rstrip() + "\n"


def _comparison(report: Report) -> list[str]:
    if not report.baseline:
        return []
    now = key_metrics(report)
    out = [
        "## Before / after",
        "",
        f"Before: the numbers embedded in `{report.baseline_source}` (an earlier run); after: "
        "this run. Same machine only if the machine sections match.",
        "",
        "| metric | before | after | change |",
        "|---|---:|---:|---:|",
    ]
    for key, after in now.items():
        before = report.baseline.get(key)
        if before is None:
            continue
        change = f"{(after - before) / before * 100:+.0f} %" if before else "-"
        out.append(f"| {key} | {before:,.2f} | {after:,.2f} | {change} |")
    return [*out, ""]


#: "Flat" per-engine cost: the per-engine figure at the largest size within this factor of 64's.
FLAT_FACTOR = 1.25


def _scale_goals(report: Report) -> list[str]:
    """Issue 18's goals, each met or not, from this run's tables."""
    by_n = {s.n: s for s in report.sizes}
    out = ["## Goals at scale (64 and 1,024 engines)", ""]
    rows: list[str] = []
    for n in (64, 1024):
        s = by_n.get(n)
        if s is None:
            rows.append(f"- N={n}: not measured in this run.")
            continue
        r = s.latency
        cpu_ratio = r.exporter_cpu_per_call / max(r.floor_cpu_per_call, 1e-12)
        rows += [
            f"- N={n}: aggregated `is_sleeping` p50 {r.ratio_p50:.2f}x the floor (goal ≤ 1.1x) — "
            f"{_goal(r.ratio_p50 <= 1.1)}; p99 {r.ratio_p99:.2f}x (goal ≤ 1.5x) — "
            f"{_goal(r.ratio_p99 <= 1.5)}.",
            f"- N={n}: exporter CPU per aggregated call {_us(r.exporter_cpu_per_call)} vs the "
            f"floor's {_us(r.floor_cpu_per_call)}, {cpu_ratio:.2f}x (goal ≤ 1.2x) — "
            f"{_goal(cpu_ratio <= 1.2)}.",
        ]
    small, big = by_n.get(64), by_n.get(max(by_n, default=0))
    if small is not None and big is not None and big.n > small.n:
        if small.poll_cpu is not None and big.poll_cpu is not None:
            a, b = small.poll_cpu.cpu_per_poll_engine, big.poll_cpu.cpu_per_poll_engine
            rows.append(
                f"- Poll CPU per engine flat from 64 to {big.n:,}: {_us(a)} → {_us(b)} "
                f"({b / a:.2f}x; goal ≤ {FLAT_FACTOR}x) — {_goal(b / a <= FLAT_FACTOR)}."
            )
        if small.scrape is not None and big.scrape is not None:
            a = small.scrape.render_p50 / small.n
            b = big.scrape.render_p50 / big.n
            rows.append(
                f"- `/metrics` render per engine flat from 64 to {big.n:,}: {_us(a)} → {_us(b)} "
                f"({b / a:.2f}x; goal ≤ {FLAT_FACTOR}x) — {_goal(b / a <= FLAT_FACTOR)}."
            )
    at1k = by_n.get(1024)
    if at1k is not None and at1k.poll_cpu is not None:
        wall = at1k.poll_cpu.wall_per_poll
        rows.append(
            f"- A full poll at 1,024 engines: {_ms(wall)} wall (goal ≤ 1 s) — {_goal(wall <= 1.0)}."
        )
    rss = sorted(report.rss, key=lambda r: r.n)
    if len(rss) >= 2:
        lo, hi = rss[0], rss[-1]
        per = (hi.rss_kib - lo.rss_kib) / (hi.n - lo.n)
        rows.append(
            f"- RSS per engine (serve, slope from {lo.n:,} to {hi.n:,} engines): "
            f"{per:,.0f} KiB; {_mib(hi.rss_kib)} at {hi.n:,} (reported; docs/scale.md has "
            "sockets and descriptors per engine)."
        )
    return [*out, *rows, ""]


def _latency_table(report: Report) -> list[str]:
    out = [
        "## 1. Aggregated `is_sleeping` latency",
        "",
        "One aggregated call = `EngineCoreClient.call_utility('is_sleeping')` on every engine + "
        "`aggregate_consensus` (exporter), vs the floor (`bench/floor.py`: blocking pyzmq, one "
        "ROUTER, one PULL shared by all engines, one request per engine, block until all "
        "replies). Each side has its own engine processes of the same shape; the sides run in "
        "alternating batches. CPU/call is the client process's CPU time (all threads) per "
        "aggregated call.",
        "",
        "| N engines | engine procs | calls | exporter p50 | exporter p99 | floor p50 | floor p99 "
        "| ratio p50 | ratio p99 | exporter CPU/call | floor CPU/call |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.sizes:
        r = s.latency
        out.append(
            f"| {r.n} | {s.processes} | {r.calls} | {_ms(r.exporter_p50)} | {_ms(r.exporter_p99)} "
            f"| {_ms(r.floor_p50)} | {_ms(r.floor_p99)} | {r.ratio_p50:.2f}x | {r.ratio_p99:.2f}x "
            f"| {_us(r.exporter_cpu_per_call)} | {_us(r.floor_cpu_per_call)} |"
        )
    at64 = next((s.latency for s in report.sizes if s.n == 64), None)
    if at64 is not None:
        out += [
            "",
            f"Goal: p50 within 1.3x of the floor at N=64 — {at64.ratio_p50:.2f}x, "
            f"{_goal(at64.ratio_p50 <= 1.3)}.",
        ]
    return [*out, ""]


def _tail_table(report: Report) -> list[str]:
    rows = [s.latency for s in report.sizes if s.latency.exporter_tail is not None]
    if not rows:
        return []
    out = [
        "### 1b. Where the p99 goes",
        "",
        "`bench/tail.py`: every call of table 1 timed for wall, process CPU (all threads) and "
        "garbage collection (`gc.callbacks`). *Tail* = the calls at or above the p99 wall time. "
        "CPU beyond the median call's is work (per-reply processing, a loop turn that batched "
        "more); wall beyond the median that is not CPU was waiting, for the engines (one "
        "simulated-engine process answers its engines one after the other) or the scheduler.",
        "",
        "| N | side | p50 | p99 | CPU, median call | CPU, tail calls | GC, tail calls "
        "| tail calls with a collection | GC, all calls | tail: work / waiting |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for side, t in (("exporter", r.exporter_tail), ("floor", r.floor_tail)):
            if t is None:
                continue
            excess = t.wall_excess_s
            work = min(t.cpu_excess_s, excess)
            split = f"{_ms(work)} / {_ms(excess - work)}" if excess > 0 else "no tail"
            out.append(
                f"| {r.n} | {side} | {_ms(t.p50_wall_s)} | {_ms(t.p99_wall_s)} "
                f"| {_us(t.median_cpu_s)} | {_us(t.tail_cpu_s)} | {_us(t.tail_gc_s)} "
                f"| {t.tail_with_gc:.0%} | {_us(t.all_gc_s)} | {split} |"
            )
    return [*out, ""]


def _scrape_table(report: Report) -> list[str]:
    rows = [s.scrape for s in report.sizes if s.scrape is not None]
    out = [
        "## 2. Scrape: `/metrics` render time and body size",
        "",
        "`exporter.exposition.render_text(exporter.collector.families())`: the rows plus the text "
        "encoder, what the `/metrics` handler runs (before gzip) when its per-state cache misses, "
        "i.e. once per poll; scrapes between two polls reuse that body. Checked byte-identical "
        "to `prometheus_client.exposition.generate_latest` in the same run. In-process, on the "
        "snapshot of a real poll against N live engines.",
        "",
        "| N engines | renders | p50 | mean | per engine (p50) | body | gzip (level 5) | samples |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.n} | {r.iterations} | {_ms(r.render_p50)} | {_ms(r.render_mean)} "
            f"| {_us(r.render_p50 / r.n)} | {r.body_bytes:,} B | {r.gzip_bytes:,} B "
            f"| {r.series:,} |"
        )
    at64 = next((r for r in rows if r.n == 64), None)
    if at64 is not None:
        out += [
            "",
            f"Goal: under 5 ms at 64 engines — {_ms(at64.render_p50)}, "
            f"{_goal(at64.render_p50 < 0.005)}; growth with N is visible in the per-engine column.",
        ]
    return [*out, ""]


def _cpu_tables(report: Report) -> list[str]:
    rows = [s.poll_cpu for s in report.sizes if s.poll_cpu is not None]
    out = [
        "## 3. Poller CPU",
        "",
        "In-process: `time.process_time()` (all threads of the exporter process, including the "
        "libzmq I/O thread; the engines run in other processes) around back-to-back "
        "`Poller.poll_once()` calls (one poll = aggregated `is_sleeping` + `is_scheduler_paused`, "
        "concurrently, plus snapshot and stats).",
        "",
        "| N engines | polls | CPU per poll | CPU per poll per engine | wall per poll |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.n} | {r.polls} | {_us(r.cpu_per_poll)} | {_us(r.cpu_per_poll_engine)} "
            f"| {_ms(r.wall_per_poll)} |"
        )
    c = report.serve_cpu
    if c is not None:
        out += [
            "",
            f"### 3b. CPU share of `serve` at a {c.poll_interval:g} s poll interval, {c.n} engines",
            "",
            "utime+stime of the `python -m exporter serve` subprocess from `/proc/<pid>/stat` "
            "over the window (no scrapes during the window).",
            "",
            "| N engines | window | polls | CPU seconds | CPU per poll | share of one core | RSS |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            f"| {c.n} | {c.window_s:.1f} s | {c.polls} | {c.cpu_s:.2f} s | {_ms(c.cpu_per_poll)} "
            f"| {c.share * 100:.2f} % | {_mib(c.rss_kib)} |",
            "",
            f"Goal: under 1 % of one core — {c.share * 100:.2f} %, {_goal(c.share < 0.01)}. "
            "(`/proc` CPU times have a 10 ms tick; the window is long enough for this to be "
            "a small error.)",
        ]
    return [*out, ""]


def _memory_table(report: Report) -> list[str]:
    out = ["## 4. Memory", ""]
    if report.rss:
        out += [
            "VmRSS of the `serve` subprocess after a few polls:",
            "",
            "| N engines | polls | RSS |",
            "|---:|---:|---:|",
        ]
        out += [f"| {r.n} | {r.polls} | {_mib(r.rss_kib)} |" for r in report.rss]
        out.append("")
    f = report.flap
    if f is not None:
        out += [
            f"### Flapping engine: RSS vs polls ({f.n} engines, "
            f"poll interval {f.poll_interval:g} s)",
            "",
            f"Engine {f.n - 1} runs in its own process that alternately sends "
            "`ENGINE_CORE_DEAD` after 200 calls and exits, or is SIGKILLed after 1.5 s; it is "
            f"restarted at once. {f.flaps} restarts, {f.handshakes} handshakes seen by the "
            f"exporter, {f.disconnected_calls:.0f} disconnected and "
            f"{f.timeout_calls:.0f} timed-out "
            f"calls, {f.elapsed_s:.0f} s.",
            "",
            "| polls | RSS | vs first |",
            "|---:|---:|---:|",
        ]
        first = f.points[0][1] if f.points else 0
        for polls, rss in f.points:
            out.append(f"| {polls:,} | {_mib(rss)} | {(rss - first) / 1024:+.1f} MiB |")
        if len(f.points) >= 2:
            growth = (f.points[-1][1] - first) / 1024
            out += [
                "",
                f"Goal: flat — {growth:+.1f} MiB from {f.points[0][0]:,} to {f.points[-1][0]:,} "
                f"polls, {_goal(abs(growth) < 2.0)} (threshold: ±2 MiB).",
            ]
    return [*out, ""]


def _admin_table(report: Report) -> list[str]:
    a = report.admin
    if a is None:
        return []
    statuses = ", ".join(f"{k}: {v}" for k, v in sorted(a.statuses.items()))
    return [
        "## 5. Admin reset end-to-end latency",
        "",
        "`POST /admin/reset_prefix_cache` over real HTTP (keep-alive connection, "
        "`--reset-min-interval 0`) to the `serve` subprocess of table 3b while it polls every "
        "1 s; the request returns after every engine answered.",
        "",
        "| N engines | requests | p50 | p99 | statuses |",
        "|---:|---:|---:|---:|---|",
        f"| {a.n} | {a.calls} | {_ms(a.p50)} | {_ms(a.p99)} | {statuses} |",
        "",
    ]


def _flood_table(report: Report) -> list[str]:
    f = report.flood
    if f is None:
        return []
    up = ", ".join(f"engine {k}: {v:g}" for k, v in sorted(f.engines_up.items()))
    return [
        "## 6. Output-address flood",
        "",
        f"A peer PUSHes 1-byte frames to engine {FLOOD_ENGINE}'s output address for "
        f"{f.seconds:g} s while the `serve` subprocess polls 2 engines every 0.2 s and "
        "`/metrics` is scraped every 100 ms; RSS is the exporter's VmRSS from `/proc`. "
        "Reproduce with `python -m bench.flood SECONDS` (or this section of `make bench`).",
        "",
        "| frames sent | frames counted | scrapes | scrape p50 | scrape p99 | scrape max "
        "| RSS before | RSS peak | RSS after | polls during flood | engines up after |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {f.sent:,} | {f.counted:,.0f} | {len(f.scrapes)} | {_ms(f.scrape_p50)} "
        f"| {_ms(f.scrape_p99)} | {_ms(f.scrape_max)} | {_mib(f.rss_before_kib)} "
        f"| {_mib(f.rss_peak_kib)} | {_mib(f.rss_after_kib)} | {f.polls} "
        f"| {'yes' if f.engines_stayed_up else '**no**'} ({up}) |",
        "",
        'Frames counted is `vllm_dp_protocol_errors_total{kind="wrong_shape"}`; it is '
        "below frames sent because the flooder's PUSH socket waits at its high-water mark "
        "while the exporter reads at its own pace, and the frames still queued when the "
        "flooder closes (LINGER 0) are discarded.",
        "",
    ]


def _profile_section(report: Report) -> list[str]:
    profiles: list[Profile] = [p for s in report.sizes for p in s.profiles]
    if not profiles:
        return []
    out = [
        "## Profile",
        "",
        "Each workload runs twice: under pyinstrument (sampling every 0.2 ms, asyncio loop "
        "included, so the time the loop spends waiting in `epoll` is reported as idle) and "
        "under cProfile (deterministic call counts; its overhead inflates small functions, so "
        "use it for *calls per operation*, not for time). Shares are of the busy (non-idle) "
        "sampled time. Both profilers slow call-heavy code down several times (compare the wall "
        "time per operation below with tables 1 and 2), so read shares, not absolute times.",
        "",
    ]
    out += _findings(report, profiles)
    for p in profiles:
        out += [
            f"### {p.title}",
            "",
            f"{p.operations} operations, {_us(p.wall_per_op)} wall per operation under the "
            f"sampler; idle (waiting in epoll/poll) {p.idle_share * 100:.0f} % of sampled time; "
            f"{p.calls_per_op:,.0f} Python/C function calls per operation (cProfile).",
            "",
        ]
        if p.categories:
            out += ["| busy time by owner | share |", "|---|---:|"]
            out += [f"| {k} | {v * 100:.1f} % |" for k, v in p.categories.items() if v >= 0.005]
            out.append("")
        if p.top_self:
            out += [
                "| top self time (pyinstrument) | where | per op | share |",
                "|---|---|---:|---:|",
            ]
            out += [
                f"| `{r.function}` | {r.where} | {_us(r.value)} | {r.share * 100:.1f} % |"
                for r in p.top_self
            ]
            out.append("")
        if p.top_calls:
            out += [
                "| top tottime (cProfile) | where | calls per op | per op | share |",
                "|---|---|---:|---:|---:|",
            ]
            out += [
                f"| `{r.function}` | {r.where} | {r.calls:,.1f} | {_us(r.value)} "
                f"| {r.share * 100:.1f} % |"
                for r in p.top_calls
            ]
            out.append("")
    return out


def _findings(report: Report, profiles: list[Profile]) -> list[str]:
    out = ["### Findings", ""]
    for s in report.sizes:
        if not s.profiles:
            continue
        lat = s.latency
        out.append(
            f"- **Client CPU per aggregated call at N={s.n}:** exporter "
            f"{_us(lat.exporter_cpu_per_call)} vs floor {_us(lat.floor_cpu_per_call)} "
            f"({lat.exporter_cpu_per_call / max(lat.floor_cpu_per_call, 1e-9):.1f}x), i.e. "
            f"{_us(lat.exporter_cpu_per_call / s.n)} vs {_us(lat.floor_cpu_per_call / s.n)} per "
            f"engine; p50 latency ratio {lat.ratio_p50:.2f}x."
        )
        exp, flo, scr = [*s.profiles, None, None, None][:3]
        if exp is not None and exp.categories:
            parts = ", ".join(f"{k} {v * 100:.0f} %" for k, v in list(exp.categories.items())[:5])
            out.append(
                f"- **Where the exporter's busy time goes (N={s.n}):** {parts}. "
                f"{exp.calls_per_op:,.0f} function calls per aggregated call "
                f"({exp.calls_per_op / s.n:,.0f} per engine) vs "
                f"{(flo.calls_per_op if flo else 0):,.0f} for the floor."
            )
            if exp.top_self:
                top = ", ".join(f"`{r.function}` {r.share * 100:.0f} %" for r in exp.top_self[:5])
                out.append(f"- **Top self time, exporter call (N={s.n}):** {top}.")
        if scr is not None and scr.top_self:
            top = ", ".join(f"`{r.function}` {r.share * 100:.0f} %" for r in scr.top_self[:5])
            cats = ", ".join(f"{k} {v * 100:.0f} %" for k, v in list(scr.categories.items())[:3])
            out.append(
                f"- **Scrape (N={s.n}):** {_us(scr.wall_per_op)} per render under the sampler; "
                f"{scr.calls_per_op:,.0f} function calls per render "
                f"({scr.calls_per_op / s.n:,.0f} per engine); {cats}; top: {top}."
            )
    out += [
        "- **What the first profile showed, and what changed.** The first run (the *before* "
        "column of the before/after table) spent a third of the exporter's busy time in "
        "pyzmq's `IntFlag` enum handling and a quarter in the zmq.asyncio layer (a Future, "
        "`_add_recv_event` and `_handle_events` per reply on each engine's PULL, a Future per "
        "send), and a scrape spent most of its time in prometheus_client's generic "
        "`generate_latest` (per-sample name validation with regexes, escaping). Changes: the "
        "data-plane sockets (`exporter/transport/dataplane.py`) are plain pyzmq sockets driven "
        "by `loop.add_reader` and drained until EAGAIN, with the Cython `send`/`recv` called "
        "with int flags; `/metrics` renders rows built once (`exporter/metrics.py`) with a lean "
        "encoder (`exporter/exposition.py`, byte-identical to `generate_latest`, checked in this "
        "run and by a test), and the body is cached until the state changes, so scrapes "
        "between two polls cost no render at all.",
        "- **The CPU gap at scale (issue 18), and what closed it.** A sampling profile of the "
        "exporter's main thread (py-spy, N=64) put a quarter of its time in the two `ZMQ_EVENTS` "
        "probes per reply (a `poll` system call inside libzmq plus pyzmq's option lookup, "
        "`python -m bench.hotpath`), then the frozen-dataclass constructors of three value "
        "objects per reply, then the event loop's own work per ready descriptor (one per engine "
        "per call: one output PULL per engine). Changes: a reader woken by its descriptor "
        "receives before it probes (one probe per reply instead of two); `EngineOutcome`, "
        "`EngineOutput` and `UtilityReply` are frozen `msgspec.Struct`s; `serve` runs on uvloop "
        "(`exporter/eventloop.py`). The libzmq I/O thread costs the two sides about the same; "
        "garbage collection is absent below 1,024 engines and under 1 % of a call there "
        "(table 1b). Step by step figures: docs/scale.md.",
    ]
    return [*out, ""]
