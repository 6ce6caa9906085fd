"""Smoke test of ``python -m bench.run``: a tiny configuration starts, runs and writes every
table. Never a timing assertion: the numbers of a quick run on a shared machine mean nothing.
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from bench.flood import sample_sum
from bench.hotpath import measure as measure_hotpath
from bench.loops import order
from bench.procs import metric_value, split_counts
from bench.tail import CallSample, GcClock, percentile, tail_of

ROOT = Path(__file__).resolve().parents[3]


def test_split_counts_spreads_engines_evenly() -> None:
    assert split_counts(256, 4) == [64, 64, 64, 64]
    assert split_counts(5, 2) == [3, 2]
    assert split_counts(1, 4) == [1]


def test_percentile_nearest_rank() -> None:
    samples = [float(i) for i in range(1, 101)]
    assert percentile(samples, 50) == 50.0
    assert percentile(samples, 99) == 99.0
    assert percentile([3.0], 99) == 3.0


def test_metric_value_reads_unlabelled_samples() -> None:
    text = '# HELP x y\nvllm_dp_polls_total 12.0\nvllm_dp_up{engine="0"} 1.0\n'
    assert metric_value(text, "vllm_dp_polls_total") == 12.0
    assert metric_value(text, "missing") is None


def test_sample_sum_reads_labelled_samples() -> None:
    text = (
        "# TYPE vllm_dp_protocol_errors counter\n"
        'vllm_dp_protocol_errors_total{kind="wrong_shape"} 7.0\n'
        'vllm_dp_protocol_errors_total{kind="extra_frames"} 2.0\n'
        "# TYPE vllm_dp_engine_up gauge\n"
        'vllm_dp_engine_up{engine="0"} 1.0\n'
    )
    assert sample_sum(text, "vllm_dp_protocol_errors_total", kind="wrong_shape") == 7.0
    assert sample_sum(text, "vllm_dp_protocol_errors_total") == 9.0
    assert sample_sum(text, "vllm_dp_engine_up", engine="0") == 1.0
    assert sample_sum(text, "vllm_dp_engine_up", engine="1") is None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_quick_bench_writes_every_table(tmp_path: Path) -> None:
    out = tmp_path / "benchmarks.md"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--quick",
            "--sizes",
            "1,2",
            "--out",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for heading in (
        "## Machine",
        "## Command",
        "## 1. Aggregated `is_sleeping` latency",
        "### 1b. Where the p99 goes",
        "## 2. Scrape",
        "## 3. Poller CPU",
        "### 3b. CPU share",
        "## 4. Memory",
        "### Flapping engine",
        "## 5. Admin reset end-to-end latency",
        "## 6. Output-address flood",
        "## Profile",
    ):
        assert heading in text, heading
    assert "Quick run" in text
    assert "## Errors" not in text
    latency = text.split("## 1.", 1)[1].split("## 2.", 1)[0]
    for n in (1, 2):
        assert f"\n| {n} | 1 | " in latency, f"no latency row for N={n}"
        for side in ("exporter", "floor"):
            assert f"\n| {n} | {side} | " in latency, f"no p99 tail row for N={n}, {side}"
    assert "event loop of the in-process tables (`--event-loop auto`): uvloop" in text
    flood = text.split("## 6.", 1)[1].split("## Profile", 1)[0]
    assert "python -m bench.flood" in flood
    assert "| yes (engine 0: 1, engine 1: 1) |" in flood, flood  # quick run: a 2 s flood
    assert "python -m bench.run --quick" in text.replace(Path(sys.executable).name, "python")


def test_tail_separates_waiting_from_work() -> None:
    """98 median calls, one slow call that only waited, one slow call that worked and collected:
    the tail (at or above p99) is those two, with their mean CPU and GC against the median."""
    samples = [CallSample(0.010, 0.005, 0.0) for _ in range(98)]
    samples += [CallSample(0.030, 0.005, 0.0), CallSample(0.040, 0.009, 0.002)]
    tail = tail_of(samples)
    assert (tail.calls, tail.tail_calls) == (100, 2)
    assert (tail.p50_wall_s, tail.p99_wall_s) == (0.010, 0.030)
    assert tail.median_cpu_s == 0.005
    assert tail.tail_cpu_s == pytest.approx(0.007)
    assert tail.cpu_excess_s == pytest.approx(0.002)
    assert tail.wall_excess_s == pytest.approx(0.020)
    assert tail.tail_gc_s == pytest.approx(0.001)
    assert tail.tail_with_gc == 0.5
    with pytest.raises(ValueError):
        tail_of([])


def test_gc_clock_times_real_collections() -> None:
    with GcClock() as clock:
        gc.collect()
    assert clock.collections >= 1 and clock.total_s > 0
    before = clock.collections
    gc.collect()  # uninstalled: no longer counted
    assert clock.collections == before


def test_hotpath_measures_every_piece() -> None:
    """``python -m bench.hotpath``'s rows, over real sockets (a few hundred operations)."""
    rows = dict(measure_hotpath(300))
    assert len(rows) == 6
    assert all(us > 0 for us in rows.values()), rows


def test_loops_bench_runs_both_loops_alternating() -> None:
    """``python -m bench.loops`` at a tiny size: a row per run, both loops, alternating."""
    assert order(2) == ["asyncio", "uvloop", "uvloop", "asyncio"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.loops", "--engines", "2", "--repeats", "1", "--calls", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| 1 | asyncio | " in proc.stdout and "| 2 | uvloop | " in proc.stdout, proc.stdout
    assert "| uvloop | " in proc.stdout.split("median exporter/floor", 1)[1]
