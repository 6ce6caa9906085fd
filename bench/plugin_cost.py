"""The ``dp_exporter`` plugin's cost on serving, against real vLLM 0.32 on CPU:
``python -m bench.plugin_cost [--runs 5] [--seconds 20] [--clients 4] [--max-tokens 32]
[--out docs/benchmarks/inprocess.md] [--log-dir DIR]``.

The last part of ``make bench`` (``BENCH_VLLM=0`` skips it): it needs the e2e suite's cached
vLLM (``e2e.vllm_install``; the first use installs it, minutes) and this checkout installed in
it (``e2e.plugin_install``).

Two deployments of ``vllm serve MODEL --data-parallel-size 2`` (2 engines, and vLLM's default of
2 API servers under internal load balancing), started one after the other and kept up for the
whole bench: **A** with ``VLLM_PLUGINS=dp_exporter`` polling every second, **B** without the
plugin (the package installed all the same). The runs alternate A B A B ...; during a run the
other deployment is frozen (SIGSTOP to its process group, SIGCONT after), so the two never share
the 2 cores. A run is ``--seconds`` of closed-loop load: ``--clients`` threads, each sending the
next greedy completion of exactly ``--max-tokens`` tokens as soon as the last one answered; its
throughput is completed requests over the run's wall time. The cost is reported as the ratio A/B
of each adjacent pair (min, max, mean, stdev).

On 2 cores that ratio is coarse: vLLM's automatic OpenMP binding makes each DP engine local rank
0 of its own world and pins both engines' workers to core 0, and one deployment's throughput
moves between runs by a factor of up to 1.6 with or without the plugin (the CPU per request
moves with it). ``VLLM_CPU_OMP_THREADS_BIND=0|1`` (one core per worker) was tried: slower and no
steadier, so the bench keeps vLLM's default, as deployed.

Measured inside vLLM's processes as well: the CPU time of every process of each deployment
(``/proc/PID/stat``) per run and, idle (no traffic) for ``--idle-seconds``, the CPU the plugin's
polling itself takes; and the poll's own wall time under load: the
``vllm_dp_poll_duration_seconds`` gauge (the last poll), read from a scrape every 5 s of each
run (B is scraped alike), and the mean round trip of one utility call from the merged
``vllm_dp_utility_call_duration_seconds`` histogram over each A run. Each run also records the
machine's CPU used outside the deployment and the load generator (``/proc/stat``): other work on
the 2 cores shows there, and the ratio is given over the quiet pairs as well. Every address is
127.0.0.1, every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.report_model import cpu_model
from e2e import plugin_install, web
from e2e.inprocess import PLUGIN, vllm_env, write_token
from e2e.ports import HOST, free_port
from e2e.procs import Managed, ProcessGroup, descendants, first_exited, process_title
from e2e.traffic import complete
from e2e.vllm_runtime import VllmRuntime, prepare_runtime, wait_api_ready

DEFAULT_OUT = "docs/benchmarks/inprocess.md"
HEADING = "# In-process mode: the plugin's cost on serving"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WARMUP_S = 3.0
#: Other work beside a run (fraction of one core) under which a pair counts as quiet.
QUIET_OTHER = 0.10
REQUEST_TIMEOUT_S = 120.0


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot (``/proc/stat``)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


def own_cpu() -> float:
    """This process's CPU seconds (the load generator's threads)."""
    times = os.times()
    return times.user + times.system


@dataclass
class Deployment:
    name: str  # "A" (plugin) or "B" (no plugin)
    server: Managed
    url: str

    @property
    def plugin(self) -> bool:
        return self.name == "A"

    def pids(self) -> list[int]:
        return [self.server.pid, *descendants(self.server.pid)]

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds of every process of the deployment, by process title
        (``VLLM::APIServer_0``, ``VLLM::EngineCore_DP1``, ...)."""
        found: dict[str, float] = {}
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            title = process_title(pid).split(" ")[0] or str(pid)
            if not title.startswith("VLLM::"):
                title = "launcher and helpers"
            ticks = int(fields[11]) + int(fields[12])  # utime, stime
            found[title] = found.get(title, 0.0) + ticks / CLOCK_TICKS
        return found

    def freeze(self, frozen: bool) -> None:
        self.server.signal_group(signal.SIGSTOP if frozen else signal.SIGCONT)

    def scrape(self) -> web.Scrape:
        reply = web.get(f"{self.url}/metrics", timeout_s=30.0)
        assert reply.status == 200, reply
        return web.Scrape(reply.body.decode())


@dataclass
class Run:
    order: int
    deployment: str
    requests: int
    errors: int
    seconds: float
    cpu_s: float
    #: CPU seconds of the machine outside the deployment and this process (other work), and
    #: stolen by the hypervisor, during the run.
    other_s: float = 0.0
    steal_s: float = 0.0
    #: The plugin's own poll while loaded (A only): the last poll's wall time, sampled every
    #: few seconds, and the mean round trip of one utility call over the run.
    polls_s: list[float] = field(default_factory=list)
    call_s: float | None = None

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_per_request_ms(self) -> float:
        return 1000 * self.cpu_s / max(1, self.requests)

    @property
    def other_share(self) -> float:
        return self.other_s / self.seconds


@dataclass
class Idle:
    deployment: str
    seconds: float
    by_process: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_share(self) -> float:
        """CPU seconds per second of the whole deployment (1.0 = one core busy)."""
        return sum(self.by_process.values()) / self.seconds


def start_deployment(
    runtime: VllmRuntime, procs: ProcessGroup, name: str, token_file: Path
) -> Deployment:
    port = free_port()
    url = f"http://{HOST}:{port}"
    plugin = name == "A"
    settings = {"POLL_INTERVAL": "1", "ADMIN_TOKEN_FILE": str(token_file)}
    env = vllm_env(runtime, PLUGIN if plugin else None, settings)
    server = procs.start(
        f"vllm-serve-{name}", runtime.data_parallel_server(port, 2), env, cwd=procs.log_dir
    )
    wait_api_ready(url, server)
    if plugin:
        web.wait_for(
            lambda: web.answers(f"{url}/dp/readyz") == 200,
            60,
            f"{url}/dp/readyz",
            abort=lambda: first_exited(server),
        )
    else:
        assert web.answers(f"{url}/dp/status") == 404, "deployment B must not load the plugin"
    complete(url, "w1 w2", 4)  # one request through, before any measurement
    return Deployment(name, server, url)


def _histogram_mean(before: web.Scrape, after: web.Scrape, name: str) -> float | None:
    count = after.total(f"{name}_count") - before.total(f"{name}_count")
    total = after.total(f"{name}_sum") - before.total(f"{name}_sum")
    return total / count if count > 0 else None


SAMPLE_EVERY_S = 5.0


def sample_scrapes(dep: Deployment, seconds: float) -> list[web.Scrape]:
    """A scrape of ``/metrics`` every ``SAMPLE_EVERY_S`` for ``seconds`` (both deployments
    alike: vLLM's own series, and in A the plugin's), on a thread beside the load."""
    scrapes: list[web.Scrape] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() + SAMPLE_EVERY_S < deadline:
        time.sleep(SAMPLE_EVERY_S)
        with contextlib.suppress(OSError, AssertionError):
            scrapes.append(dep.scrape())
    return scrapes


def load(url: str, clients: int, seconds: float, max_tokens: int) -> tuple[int, int, float]:
    """Closed-loop load for ``seconds``: (completed, errors, wall seconds until the last
    request that started in time answered)."""
    deadline = time.monotonic() + seconds
    counts = [0] * clients
    errors = [0] * clients

    def client(i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            try:
                out = complete(url, f"w{i} w{n % 400} w{(n * 7) % 400}", max_tokens,
                               REQUEST_TIMEOUT_S)  # fmt: skip
                assert out["usage"]["completion_tokens"] == max_tokens, out["usage"]
                counts[i] += 1
            except (AssertionError, OSError):
                errors[i] += 1
            n += 1

    started = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + REQUEST_TIMEOUT_S + 10)
    return sum(counts), sum(errors), time.monotonic() - started


@contextlib.contextmanager
def only(active: Deployment, others: Sequence[Deployment]) -> Iterator[None]:
    """``active`` alone on the machine: the others frozen for the duration."""
    for other in others:
        other.freeze(True)
    try:
        yield
    finally:
        for other in others:
            other.freeze(False)


def measure_run(order: int, dep: Deployment, clients: int, seconds: float, max_tokens: int) -> Run:
    load(dep.url, clients, WARMUP_S, max_tokens)
    before = dep.scrape()
    machine0, mine0, cpu0 = machine_cpu(), own_cpu(), dep.cpu_seconds()
    samples: list[web.Scrape] = []
    sampler = threading.Thread(
        target=lambda: samples.extend(sample_scrapes(dep, seconds)), daemon=True
    )
    sampler.start()
    requests, errors, took = load(dep.url, clients, seconds, max_tokens)
    machine1, mine1, cpu1 = machine_cpu(), own_cpu(), dep.cpu_seconds()
    sampler.join(SAMPLE_EVERY_S + 35)
    after = dep.scrape()
    cpu = sum(cpu1.values()) - sum(cpu0.values())
    other = (machine1[0] - machine0[0]) - cpu - (mine1 - mine0)
    run = Run(order, dep.name, requests, errors, took, cpu, max(0.0, other))
    run.steal_s = machine1[1] - machine0[1]
    if dep.plugin:
        for s in samples:
            value = s.value("vllm_dp_poll_duration_seconds")
            if value is not None:
                run.polls_s.append(value)
        run.call_s = _histogram_mean(before, after, "vllm_dp_utility_call_duration_seconds")
    return run


def measure_idle(dep: Deployment, seconds: float) -> Idle:
    before = dep.cpu_seconds()
    time.sleep(seconds)
    after = dep.cpu_seconds()
    return Idle(dep.name, seconds, {k: after[k] - before.get(k, 0.0) for k in after})


@dataclass
class Result:
    command: str
    runs: list[Run]
    idle: list[Idle]
    started: datetime.datetime
    elapsed_s: float
    clients: int
    seconds: float
    max_tokens: int
    vllm_version: str
    load_start: str
    load_end: str

    def pairs(self) -> list[float]:
        a = [r.rps for r in self.runs if r.deployment == "A"]
        b = [r.rps for r in self.runs if r.deployment == "B"]
        return [x / y for x, y in zip(a, b, strict=False)]

    def quiet_pairs(self) -> list[float]:
        """The ratios of the pairs in which neither run saw other work on the machine (under
        ``QUIET_OTHER`` of one core beside the deployment and the load generator)."""
        a = [r for r in self.runs if r.deployment == "A"]
        b = [r for r in self.runs if r.deployment == "B"]
        return [
            x.rps / y.rps
            for x, y in zip(a, b, strict=False)
            if x.other_share < QUIET_OTHER and y.other_share < QUIET_OTHER
        ]


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "none"
    stdev = statistics.stdev(values) if len(values) > 1 else 0.0
    return (
        f"median {statistics.median(values):.3f}, mean {statistics.fmean(values):.3f}, "
        f"min {min(values):.3f}, max {max(values):.3f}, stdev {stdev:.3f} (n={len(values)})"
    )


def section(r: Result) -> list[str]:
    ratios = r.pairs()
    a = [x.rps for x in r.runs if x.deployment == "A"]
    b = [x.rps for x in r.runs if x.deployment == "B"]
    polls = [p for x in r.runs for p in x.polls_s]
    calls = [x.call_s for x in r.runs if x.call_s is not None]
    lines = [
        HEADING,
        "",
        "Generated by `python -m bench.plugin_cost` (the last part of `make bench`, which runs "
        "it after installing the e2e suite's vLLM; `BENCH_VLLM=0` skips it). Each deployment "
        "is `vllm serve` of the e2e suite's tiny model with "
        "`--data-parallel-size 2` (2 engines, vLLM's default 2 API servers), float32, "
        "`--enforce-eager`; **A** loads the `dp_exporter` plugin polling every second, **B** "
        "does not. Runs alternate A B A B ...; the idle deployment is frozen (SIGSTOP) during "
        "each run. See the module docstring of `bench/plugin_cost.py` for the method.",
        "",
        "## Command",
        "",
        "```",
        r.command,
        "```",
        "",
        "## Machine",
        "",
        f"- date: {r.started:%Y-%m-%d %H:%M} UTC; bench time {r.elapsed_s:.0f} s",
        f"- CPU: {cpu_model()}, {os.cpu_count()} logical cores",
        f"- Kernel: {platform.system()} {platform.release()}; Python {platform.python_version()}",
        f"- vLLM {r.vllm_version} (vllm-cpu)",
        f"- load average at start / end (1/5/15 min): {r.load_start}; {r.load_end}",
        "",
        "## Throughput with and without the plugin",
        "",
        f"{r.clients} closed-loop clients, completions of exactly {r.max_tokens} tokens, "
        f"{r.seconds:g} s per run (after {WARMUP_S:g} s of warm-up).",
        "",
        '"deployment CPU" is every process of the deployment (API servers, engines, their '
        'workers), "other CPU" the rest of the machine beside the load generator: other work '
        "sharing the 2 cores, which the pairs counted as quiet did not have.",
        "",
        "| run | deployment | requests | errors | seconds | requests/s | deployment CPU ms "
        "per request | other CPU (cores) | steal (cores) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r.runs:
        lines.append(
            f"| {x.order} | {x.deployment} | {x.requests} | {x.errors} | {x.seconds:.1f} "
            f"| {x.rps:.2f} | {x.cpu_per_request_ms:.0f} | {x.other_share:.2f} "
            f"| {x.steal_s / x.seconds:.2f} |"
        )
    lines += [
        "",
        f"- requests/s, A (plugin): {_spread(a)}",
        f"- requests/s, B (no plugin): {_spread(b)}",
        f"- **ratio A/B of adjacent runs: {_spread(ratios)}** (1.000 = no cost; below 1 the "
        "plugin costs throughput)",
        f"- ratio A/B of the quiet pairs (other CPU under {QUIET_OTHER:.2f} of a core in both "
        f"runs): {_spread(r.quiet_pairs())}",
        "",
        "Reading these: on 2 cores the run-to-run spread of one deployment is large with or "
        "without the plugin (vLLM's automatic OpenMP binding pins both DP engines' workers to "
        "core 0, each being local rank 0 of its own world, and their spinning threads share it; "
        "the CPU per request moves with the throughput), so the ratio bounds the plugin's cost "
        "only coarsely. The precise figure is the CPU the polling takes, below: idle, A minus B.",
        "",
        "## The poll's own cost inside vLLM",
        "",
    ]
    if polls:
        lines.append(
            "- one poll (4 utility calls to each of 2 engines: is_sleeping, is_scheduler_paused, "
            "get_weight_version, has_work, from API server 0), wall time "
            f"under load, sampled every {SAMPLE_EVERY_S:g} s: "
            f"{_spread([p * 1000 for p in polls])} ms"
        )
    if calls:
        lines.append(
            f"- one utility call's round trip under load: {_spread([c * 1000 for c in calls])} ms"
        )
    for idle in r.idle:
        parts = ", ".join(f"{k} {v / idle.seconds:.1%}" for k, v in sorted(idle.by_process.items()))
        lines.append(
            f"- idle CPU of deployment {idle.deployment} over {idle.seconds:g} s: "
            f"{idle.cpu_share:.1%} of one core ({parts})"
        )
    if len(r.idle) == 2:
        delta = r.idle[0].cpu_share - r.idle[1].cpu_share
        lines.append(
            f"- idle difference A - B (the plugin's polling in 2 API servers, and the engines "
            f"answering it): {delta:+.1%} of one core"
        )
    return lines


def run(args: argparse.Namespace, command: str) -> Result:
    started_at = datetime.datetime.now(datetime.timezone.utc)
    started = time.monotonic()
    load_start = _load()
    runtime = prepare_runtime()
    installed = plugin_install.install(runtime.version)
    print(f"bench: {plugin_install.DIST} in {installed.venv} ({installed.seconds:.1f} s)")
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench-plugin-"))
    procs = ProcessGroup(log_dir)
    print(f"bench: vLLM logs in {log_dir}", flush=True)
    token_file, _ = write_token(log_dir)
    deployments: list[Deployment] = []
    runs: list[Run] = []
    idle: list[Idle] = []
    try:
        for name in ("A", "B"):
            t0 = time.monotonic()
            # The one already up is frozen while the next one starts (each starts alone).
            for d in deployments:
                d.freeze(True)
            try:
                deployments.append(start_deployment(runtime, procs, name, token_file))
            finally:
                for d in deployments:
                    d.freeze(False)
            print(f"bench: deployment {name} ready in {time.monotonic() - t0:.0f} s", flush=True)
        a, b = deployments
        for dep in (a, b):
            with only(dep, [d for d in deployments if d is not dep]):
                wait_api_ready(dep.url, dep.server)
                idle.append(measure_idle(dep, args.idle_seconds))
            print(f"bench: idle {dep.name}: {idle[-1].cpu_share:.1%} of one core", flush=True)
        order = 0
        for _ in range(args.runs):
            for dep in (a, b):
                order += 1
                with only(dep, [d for d in deployments if d is not dep]):
                    wait_api_ready(dep.url, dep.server)
                    r = measure_run(order, dep, args.clients, args.seconds, args.max_tokens)
                runs.append(r)
                print(
                    f"bench: run {order} {dep.name}: {r.requests} requests in {r.seconds:.1f} s "
                    f"= {r.rps:.2f}/s, {r.errors} errors",
                    flush=True,
                )
    finally:
        for d in deployments:
            d.freeze(False)
        procs.stop_all()
    return Result(
        command,
        runs,
        idle,
        started_at,
        time.monotonic() - started,
        args.clients,
        args.seconds,
        args.max_tokens,
        runtime.version,
        load_start,
        _load(),
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plugin_cost", description=__doc__)
    p.add_argument("--runs", type=int, default=5, help="runs of each deployment (>= 2)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of one run")
    p.add_argument("--clients", type=int, default=4, help="concurrent closed-loop clients")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    p.add_argument("--idle-seconds", type=float, default=20.0, help="idle CPU window")
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown report ('-': stdout only)")
    p.add_argument("--log-dir", help="vLLM logs (default: a new temporary directory)")
    args = p.parse_args(argv)
    if args.runs < 2:
        p.error("--runs must be at least 2 (the spread needs pairs)")
    command = shlex.join(["python", "-m", "bench.plugin_cost", *(argv or sys.argv[1:])])
    result = run(args, command)
    text = "\n".join(section(result)) + "\n"
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)
        print(f"bench: wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
