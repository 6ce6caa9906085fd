"""A simulated engine's requests: they run for a while, and queue behind a paused scheduler
(pure: time comes in as ``now``, from whoever drives the engine).

As vLLM's scheduler: a request waits until the scheduler admits it (at most ``max_running`` run
at once, none while paused), then runs for its duration. Pausing with ``"abort"`` drops every
request, ``"keep"`` freezes them where they are, and ``"wait"`` lets the running ones finish
while new ones queue (what vLLM RFC #51476 describes: a paused scheduler is not a quiet one).
``has_work`` is vLLM's ``EngineCore.has_work``: anything running or waiting.

A running request computes ``TOKENS_PER_S`` tokens a second (``tokens``: what vLLM counts as
``vllm:generation_tokens_total``). A ``stuck`` engine (a scheduler holding requests it never
schedules, a step blocked on a KV transfer) keeps its requests and computes nothing, while it
still answers every call: it reads ``stalled`` where a source counts its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Requests a simulated engine runs at once (vLLM's ``max_num_seqs``, much smaller).
MAX_RUNNING = 4
#: The demo story's traffic: one request arrives every this many seconds while it flows, and
#: runs this long once scheduled.
DEMO_ARRIVAL_S = 0.5
DEMO_REQUEST_S = 1.2
#: Tokens one running request computes a second.
TOKENS_PER_S = 50.0


@dataclass
class Work:
    """The requests of one simulated engine, in seconds of work left."""

    max_running: int = MAX_RUNNING
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    #: Whether the scheduler admits and runs requests; ``drain`` lets the running ones finish
    #: while paused (a pause with mode ``"wait"``).
    paused: bool = False
    drain: bool = False
    #: Computes nothing and runs nothing, its requests held (a test's or the story's fault).
    stuck: bool = False
    #: Tokens computed so far (whole ones; ``_part`` keeps the fraction).
    tokens: int = 0
    _part: float = 0.0
    _at: float | None = None

    def submit(self, duration_s: float, now: float, count: int = 1) -> None:
        """``count`` requests of ``duration_s`` seconds each arrive (they wait first)."""
        self.advance(now)
        self.waiting.extend([max(0.0, duration_s)] * count)
        self.advance(now)

    def advance(self, now: float) -> None:
        """Run the requests up to ``now``: admit, then run, then admit into freed slots."""
        elapsed = 0.0 if self._at is None else max(0.0, now - self._at)
        self._at = now
        if self.stuck:
            return
        self._admit()
        if self.running and (not self.paused or self.drain):
            self._part += sum(min(left, elapsed) for left in self.running) * TOKENS_PER_S
            self.tokens += int(self._part)
            self._part -= int(self._part)
            self.running = [left - elapsed for left in self.running if left - elapsed > 0]
        self._admit()

    def _admit(self) -> None:
        if self.paused:
            return
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))

    def pause(self, mode: str, now: float) -> float:
        """Pause the scheduler; returns how long the running requests still need (``"wait"``:
        the pause answers then; 0 for the other modes)."""
        self.advance(now)
        self.paused, self.drain = True, mode == "wait"
        if mode == "abort":
            self.running.clear()
            self.waiting.clear()
        return max(self.running, default=0.0) if self.drain else 0.0

    def resume(self, now: float) -> None:
        self.advance(now)
        self.paused = self.drain = False
        self._admit()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def counts(self) -> tuple[int, int]:
        """(running, waiting)."""
        return len(self.running), len(self.waiting)
