"""Output-address flood: ``serve`` with 2 simulated engines while a peer PUSHes tiny frames to
engine 1's output address (docs/reliability.md, row A5).

The exporter, the two engines and the flooder are separate processes, so the exporter's RSS is
its own. During the flood ``/metrics`` is scraped every 100 ms (the latency of each scrape is
recorded) and the exporter's VmRSS is sampled from ``/proc``.
``tests/integration/resilience/test_flood.py`` runs the same scenario for a few seconds and
asserts bounds on these figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.procs import (
    engine_fleet,
    free_address,
    http_get,
    proc_rss_kib,
    serve_process,
    stop_process,
    wait_ready,
)
from bench.tail import percentile

ENGINES = 2
FLOOD_ENGINE = 1
SCRAPE_EVERY_S = 0.1

FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.setsockopt(zmq.LINGER, 0)
s.connect(sys.argv[1])
end = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < end:
    for _ in range(1000):
        s.send(b"x")
    sent += 1000
print(sent)
s.close(linger=0)
ctx.term()
"""


@dataclass
class FloodResult:
    seconds: float
    sent: int = 0
    counted: float = 0.0  # vllm_dp_protocol_errors_total{kind="wrong_shape"}
    scrapes: list[float] = field(default_factory=list)  # seconds, one per scrape during the flood
    rss_before_kib: int = 0
    rss_peak_kib: int = 0
    rss_after_kib: int = 0
    polls: int = 0  # polls completed during the flood
    engines_up: dict[str, float] = field(default_factory=dict)

    @property
    def engines_stayed_up(self) -> bool:
        return len(self.engines_up) == ENGINES and all(v == 1.0 for v in self.engines_up.values())

    @property
    def scrape_p50(self) -> float:
        return percentile(self.scrapes, 50) if self.scrapes else 0.0

    @property
    def scrape_p99(self) -> float:
        return percentile(self.scrapes, 99) if self.scrapes else 0.0

    @property
    def scrape_max(self) -> float:
        return max(self.scrapes, default=0.0)


def sample_sum(text: str, family: str, **labels: str) -> float | None:
    """Sum of the samples of ``family`` whose labels include ``labels`` (None when none)."""
    base = family.removesuffix("_total")
    found: float | None = None
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (base, base + "_total") and labels.items() <= s.labels.items():
                found = (found or 0.0) + float(s.value)
    return found


def _metrics(url: str) -> str:
    status, body = http_get(url + "/metrics", 10.0)
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    return body.decode()


def run_flood(seconds: float, log_dir: Path, *, poll_interval: float = 0.2) -> FloodResult:
    """The flood scenario for ``seconds``; raises if the exporter dies or stops answering."""
    result = FloodResult(seconds)
    address = free_address()
    with (
        engine_fleet(address, ENGINES, log_dir, processes=ENGINES),
        serve_process(
            address, ENGINES, log_dir, poll_interval=poll_interval, call_timeout=1.0
        ) as serve,
    ):
        wait_ready(serve, 60.0)
        _, status = http_get(serve.url + "/status", 5.0)
        target = str(json.loads(status)["engines"][FLOOD_ENGINE]["address"])
        polls_before = sample_sum(_metrics(serve.url), "vllm_dp_polls_total") or 0.0
        result.rss_before_kib = proc_rss_kib(serve.pid)
        flooder = subprocess.Popen(
            [sys.executable, "-c", FLOODER, target, str(seconds)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        try:
            peak = result.rss_before_kib
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                if serve.proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {serve.proc.returncode}")
                started = time.perf_counter()
                _metrics(serve.url)
                result.scrapes.append(time.perf_counter() - started)
                peak = max(peak, proc_rss_kib(serve.pid))
                time.sleep(SCRAPE_EVERY_S)
            result.rss_peak_kib = peak
            out, _ = flooder.communicate(timeout=30.0)
        finally:
            stop_process(flooder)
        result.sent = int(out.strip() or 0)
        after = _metrics(serve.url)
        result.rss_after_kib = proc_rss_kib(serve.pid)
        result.polls = int((sample_sum(after, "vllm_dp_polls_total") or 0.0) - polls_before)
        result.counted = sample_sum(after, "vllm_dp_protocol_errors_total", kind="wrong_shape") or 0
        for engine in map(str, range(ENGINES)):
            up = sample_sum(after, "vllm_dp_engine_up", engine=engine)
            result.engines_up[engine] = -1.0 if up is None else up
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.flood [SECONDS]``: run the flood alone and print the figures."""
    import tempfile

    args = sys.argv[1:] if argv is None else argv
    seconds = float(args[0]) if args else 20.0
    with tempfile.TemporaryDirectory(prefix="bench-flood-") as tmp:
        r = run_flood(seconds, Path(tmp))
    print(
        f"flood {r.seconds:g} s: sent {r.sent:,}, counted {r.counted:,.0f}; "
        f"scrapes {len(r.scrapes)} p50 {r.scrape_p50 * 1e3:.1f} ms "
        f"p99 {r.scrape_p99 * 1e3:.1f} ms max {r.scrape_max * 1e3:.1f} ms; "
        f"RSS before {r.rss_before_kib / 1024:.1f} peak {r.rss_peak_kib / 1024:.1f} "
        f"after {r.rss_after_kib / 1024:.1f} MiB; polls {r.polls}; "
        f"engines up {r.engines_stayed_up}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
