"""``python -m bench.hotpath``: what one engine's reply costs the exporter, piece by piece.

The measurements behind the per-reply decisions in ``exporter/client/enginecore/links.py`` and the
value types (docs/benchmarks/README.md, "CPU per call"): a ``ZMQ_EVENTS`` probe (a ``poll`` system
call inside libzmq plus pyzmq's option lookup) against a receive that finds nothing (a
``zmq.Again`` exception), a zero-copy receive with its source descriptor against a copying
one, and a frozen dataclass against a frozen ``msgspec.Struct`` for the per-engine outcome.
All on one PULL over 127.0.0.1 TCP in this process; µs per operation, best of three rounds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import field, make_dataclass
from typing import Any

import msgspec
import msgspec.structs
import zmq

from exporter.client.enginecore.links import EVENTS, NOBLOCK, SRCFD, get_option, recv_frame
from exporter.client.fleet import EngineOutcome, Outcome

ROUNDS = 3


def frozen_dataclass_like(struct: type[msgspec.Struct]) -> type:
    """A frozen, slotted dataclass with ``struct``'s fields and defaults (what the per-engine
    value types were before they became Structs), derived so that the two never drift apart."""
    specs: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(struct):
        specs.append((f.name, Any) if f.required else (f.name, Any, field(default=f.default)))
    return make_dataclass(f"Frozen{struct.__name__}", specs, frozen=True, slots=True)


FrozenOutcome = frozen_dataclass_like(EngineOutcome)


def best_us(fn: Callable[[int], None], count: int) -> float:
    """Best of ``ROUNDS`` runs of ``fn(count)``, in µs per operation."""
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.perf_counter()
        fn(count)
        best = min(best, (time.perf_counter() - started) / count * 1e6)
    return best


class Queue:
    """A PULL with ``count`` small frames queued by a PUSH over loopback TCP."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.push = self.ctx.socket(zmq.PUSH)
        for sock in (self.pull, self.push):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
        self.pull.bind("tcp://127.0.0.1:*")
        self.push.connect(self.pull.getsockopt_string(zmq.LAST_ENDPOINT))

    def fill(self, count: int, timeout_s: float = 30.0) -> None:
        for _ in range(count):
            self.push.send(b"\x99" * 64)
        deadline = time.monotonic() + timeout_s
        while not self.pull.poll(10):  # until the first one arrived
            if time.monotonic() > deadline:
                raise RuntimeError("bench.hotpath: nothing arrived on the PULL")
        time.sleep(0.5)  # and the rest

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)
        self.ctx.term()


def measure(count: int = 20_000) -> list[tuple[str, float]]:
    """(operation, µs) rows."""
    q = Queue()
    pull = q.pull
    rows: list[tuple[str, float]] = []
    try:

        def recv_zero_copy(k: int) -> None:
            for _ in range(k):
                frame = recv_frame(pull, NOBLOCK, copy=False)
                frame.get(SRCFD)
                frame.bytes  # noqa: B018 - the copy out is part of the cost
                frame.more  # noqa: B018

        def recv_copy(k: int) -> None:
            for _ in range(k):
                recv_frame(pull, NOBLOCK)

        def probe(k: int) -> None:
            for _ in range(k):
                get_option(pull, EVENTS)

        def again(k: int) -> None:
            for _ in range(k):
                try:
                    recv_frame(pull, NOBLOCK)
                except zmq.Again:  # the exception is what is measured
                    continue

        for name, fn in (
            ("receive, zero-copy + ZMQ_SRCFD + bytes + more (the exporter's)", recv_zero_copy),
            ("receive, copying (no source descriptor)", recv_copy),
        ):
            best = float("inf")
            for _ in range(ROUNDS):
                q.fill(count)
                started = time.perf_counter()
                fn(count)
                best = min(best, (time.perf_counter() - started) / count * 1e6)
            rows.append((name, best))
        rows.append(("ZMQ_EVENTS probe on an empty socket", best_us(probe, count)))
        rows.append(("receive on an empty socket (zmq.Again raised)", best_us(again, count)))
    finally:
        q.close()

    def frozen_dataclass(k: int) -> None:
        for _ in range(k):
            FrozenOutcome("7", Outcome.OK, False, duration_s=0.001)

    def frozen_struct(k: int) -> None:
        for _ in range(k):
            EngineOutcome("7", Outcome.OK, False, duration_s=0.001)

    assert issubclass(EngineOutcome, msgspec.Struct)
    rows.append(("outcome as a frozen dataclass (slots)", best_us(frozen_dataclass, count)))
    rows.append(
        ("outcome as a frozen msgspec.Struct (EngineOutcome)", best_us(frozen_struct, count))
    )
    return rows


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    print("| operation | µs |")
    print("|---|---:|")
    for name, us in measure(count):
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
