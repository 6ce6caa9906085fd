"""``python -m bench.scale``: resources per engine (ZMQ sockets, file descriptors, memory) of the
exporter at 64, 256 and 1,024 engines, owner and relay mode (docs/scale.md).

- **ZMQ sockets**: measured, not counted by hand: the smallest context ``MAX_SOCKETS`` with
  which the data plane over N engines starts (a bisection over real starts, in this process).
  The relay adds one upstream DEALER per engine while that engine's handshake is relayed.
- **Descriptors and memory**: ``python -m exporter serve`` as a subprocess over N simulated
  engines (other processes, many per process): the number of entries in ``/proc/PID/fd`` (peak
  while the engines handshake, and steady after a few polls) and VmRSS after a few polls.
  Relay mode runs a simulated stock front end (``exporter.sim.frontend``) in its own process.

Options: ``--sizes 64,256,1024``, ``--modes owner,relay``, ``--out PATH`` (Markdown table,
default: stdout only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio

from bench.procs import (
    engine_fleet,
    free_address,
    http_get,
    metric_value,
    proc_rss_kib,
    serve_process,
    stop_process,
)
from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore import sockets
from exporter.client.owner.transport import OwnerConfig, OwnerTransport
from exporter.protocol import EngineOutput

FRONTEND = """
import asyncio, sys
from exporter.sim.frontend import SimFrontend
async def main():
    frontend = SimFrontend(sys.argv[1], int(sys.argv[2]))
    await frontend.start(call_loop=False)
    await asyncio.Event().wait()
asyncio.run(main())
"""


class _Quiet:
    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        return False

    def on_engine_hello(self, engine_index: int) -> None:
        return None

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        pass

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        pass

    def on_death_claimed(self, engine_index: int) -> None:
        pass


class _Unchecked(OwnerTransport):
    def check_resources(self) -> None:  # the probe sets the limit itself
        pass


async def _starts_with(n: int, max_sockets: int) -> bool:
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, max_sockets)
    config = OwnerConfig(handshake_address=free_address(), engine_count=n)
    transport = _Unchecked(config, _Quiet(), ProtocolErrorTally(), context=ctx)
    try:
        await transport.start()
    except zmq.ZMQError:
        return False
    finally:
        await transport.close()
        ctx.term()
    return True


async def min_sockets(n: int) -> int:
    """The smallest ``MAX_SOCKETS`` with which an owner data plane over ``n`` engines starts."""
    lo, hi = 1, 4 * n + 64  # lo fails, hi works
    if not await _starts_with(n, hi):
        raise RuntimeError(f"N={n}: does not start even with MAX_SOCKETS={hi}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if await _starts_with(n, mid):
            hi = mid
        else:
            lo = mid
    return hi


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class ServeResources:
    mode: str
    n: int
    fds_peak: int
    fds_steady: int
    rss_kib: int
    start_s: float  # serve start → every engine connected and one poll done


@contextlib.contextmanager
def _frontend(address: str, n: int, log_dir: Path) -> Iterator[None]:
    log = open(log_dir / "frontend.log", "ab")  # noqa: SIM115
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", FRONTEND, address, str(n)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )
    finally:
        log.close()
    try:
        yield
    finally:
        stop_process(proc)


def serve_resources(
    mode: str, n: int, log_dir: Path, *, polls: int = 3, timeout_s: float = 180.0
) -> ServeResources:
    """``serve`` over ``n`` engines: peak descriptors while they handshake, steady descriptors
    and RSS after ``polls`` polls with every engine connected."""
    address = free_address()
    extra: list[str] = []
    with contextlib.ExitStack() as stack:
        if mode == "relay":
            upstream = free_address()
            stack.enter_context(_frontend(upstream, n, log_dir))
            extra = ["--attach", "relay", "--upstream-handshake-address", upstream]
            extra += ["--state-file", str(log_dir / f"relay-state-{n}.json")]
        serve = stack.enter_context(
            serve_process(
                address, n, log_dir, poll_interval=0.5, call_timeout=5.0, extra_args=extra
            )
        )
        t0 = time.monotonic()
        stack.enter_context(engine_fleet(address, n, log_dir))
        peak, first_poll = 0, None
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if serve.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {serve.proc.returncode} (logs: {log_dir})")
            peak = max(peak, fd_count(serve.pid))
            with contextlib.suppress(OSError):
                status, body = http_get(serve.url + "/metrics", 5.0)
                text = body.decode()
                connected = metric_value(text, "vllm_dp_engines_connected") or 0
                done = metric_value(text, "vllm_dp_polls_total") or 0
                if status == 200 and connected >= n:
                    if first_poll is None:
                        first_poll = done
                    elif done >= first_poll + polls:
                        break
            time.sleep(0.05)
        else:
            raise TimeoutError(f"{mode} N={n}: not every engine connected in {timeout_s:g}s")
        start_s = time.monotonic() - t0
        return ServeResources(mode, n, peak, fd_count(serve.pid), proc_rss_kib(serve.pid), start_s)


def render(sockets_by_n: dict[int, int], rows: list[ServeResources], command: str) -> str:
    lines = [
        f"Command: `{command}`",
        "",
        "| N engines | ZMQ sockets (min. MAX_SOCKETS) | per engine | needed by the formula |",
        "|---:|---:|---:|---:|",
    ]
    for n, count in sorted(sockets_by_n.items()):
        formula = sockets.sockets_needed(n)
        lines.append(f"| {n:,} | {count:,} | {count / n:.2f} | {formula:,} |")
    lines += [
        "",
        "| mode | N engines | fds peak (handshakes) | fds steady | per engine (steady, slope) "
        "| RSS | RSS per engine (slope) | start to first full poll |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        prev = next((p for p in reversed(rows) if p.mode == r.mode and p.n < r.n), None)
        if prev is None:
            fd_slope = rss_slope = "-"
        else:
            dn = r.n - prev.n
            fd_slope = f"{(r.fds_steady - prev.fds_steady) / dn:.2f}"
            rss_slope = f"{(r.rss_kib - prev.rss_kib) / dn:.1f} KiB"
        lines.append(
            f"| {r.mode} | {r.n:,} | {r.fds_peak:,} | {r.fds_steady:,} | {fd_slope} "
            f"| {r.rss_kib / 1024:.1f} MiB | {rss_slope} | {r.start_s:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--sizes", default="64,256,1024")
    p.add_argument("--modes", default="owner,relay")
    p.add_argument("--out", help="also write the tables to this file")
    p.add_argument("--skip-sockets", action="store_true", help="no MAX_SOCKETS bisection")
    args = p.parse_args(argv)
    sizes = sorted({int(x) for x in args.sizes.split(",") if x})
    modes = [m for m in args.modes.split(",") if m]
    command = "python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:])
    sockets_by_n: dict[int, int] = {}
    if not args.skip_sockets:
        for n in sizes:
            sockets_by_n[n] = asyncio.run(min_sockets(n))
            print(f"N={n}: {sockets_by_n[n]} sockets", file=sys.stderr, flush=True)
    rows: list[ServeResources] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for mode in modes:
            for n in sizes:
                rows.append(serve_resources(mode, n, Path(tmp)))
                print(rows[-1], file=sys.stderr, flush=True)
    text = render(sockets_by_n, rows, command.strip())
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
