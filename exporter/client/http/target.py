"""The two kinds of HTTP-mode target and what the client knows of each
(``exporter.client.http.client``): a dev-routes server (``TargetState``: whether it answered,
its vLLM version, its requests as its last ``has_work`` read found them) and a plugin-enabled
server (``PluginTargetState``, URL ending in ``/dp``: also the ranks its ``/dp/gate`` answers
name, followed answer by answer (``plugin.follow_ranks``) so a target holds at most
``MAX_ENGINES`` engines and none its server stopped naming, each rank's requests, and the gate
answer its read methods share).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fleet import PYTHON_FRONT_END, RUST_FRONT_END
from exporter.client.http.fault import FaultRead
from exporter.client.http.plugin import (
    GateAnswer,
    engine_label,
    follow_ranks,
    is_plugin_url,
    server_root,
)
from exporter.protocol.activity import RequestCounts
from exporter.protocol.handshake import MAX_REGISTRATION_STRING
from exporter.protocol.progress import RankProgress
from exporter.protocol.strings import bound_text


def front_end_of(version_answer: dict[str, Any]) -> tuple[str, str | None]:
    """Which front end answered ``GET /version`` (a map with a ``version`` string): the Rust
    front end adds ``rust_frontend_version``; the Python API server does not. A value that is
    not a string still says Rust (its version then unknown); it is cut like ``vllm_version``."""
    if "rust_frontend_version" not in version_answer:
        return PYTHON_FRONT_END, None
    value = version_answer["rust_frontend_version"]
    if not isinstance(value, str):
        return RUST_FRONT_END, None
    return RUST_FRONT_END, bound_text(value[:MAX_REGISTRATION_STRING])


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """One vLLM API server: its engine label and its base URL (no trailing slash)."""

    label: str
    url: str


@dataclass(slots=True)
class TargetState:
    """A dev-routes target: one API server that is one engine to the exporter (its answers are
    vLLM's own aggregate over the ranks it manages)."""

    target: HttpTarget
    connected: bool = False
    #: HTTP requests sent to it (all routes).
    requests: int = 0
    #: Its running and waiting requests (``/metrics``, summed over its ranks) as the last
    #: ``has_work`` read found them; None after any failure.
    request_counts: RequestCounts | None = None
    #: Its computed tokens (``/metrics``, summed over its ranks) as the last ``has_work`` read
    #: found them, and when they last grew; None after any failure.
    progress: RankProgress | None = None
    #: From ``GET /version``, asked once the target answers (for ``vllm_dp_engine_info``).
    vllm_version: str | None = None
    #: ``python`` or ``rust`` (``GET /version`` names ``rust_frontend_version``), and that.
    front_end: str | None = None
    rust_frontend_version: str | None = None
    version_pending: bool = False
    #: ``GET /fault_tolerance/status`` (``fault``): the worst of the server's ranks.
    fault_read: FaultRead = field(init=False)

    def __post_init__(self) -> None:
        self.fault_read = FaultRead(self.target.label, self.target.url, per_rank=False)

    def labels(self) -> list[str]:
        return [self.target.label]

    def counts_by_label(self) -> dict[str, RequestCounts | None]:
        """Each engine label of the target → its requests (None: unknown)."""
        return {self.target.label: self.request_counts}


@dataclass(slots=True)
class PluginTargetState(TargetState):
    """A plugin-enabled server (URL ending in ``/dp``): each rank its ``/dp/gate`` names is an
    engine of its own, followed answer by answer; read by ``plugin_read.PluginReads``."""

    ranks: list[str] = field(default_factory=list)
    #: Each rank → its requests as the gate answer ``counted`` said (absent: unknown).
    rank_counts: dict[str, RequestCounts] = field(default_factory=dict)
    counted: GateAnswer | None = None
    #: Each rank of ``ranks`` → gate answers in a row that did not name it.
    absent: dict[str, int] = field(default_factory=dict)
    #: The gate answer ``ranks`` last followed (each answer moves them once, whichever of the
    #: poll's read methods reads it first).
    followed: GateAnswer | None = None
    #: The gate answer of the poll running now, shared by its read methods.
    sample: asyncio.Task[GateAnswer] | None = None
    sampled_at: float = 0.0
    #: The last gate answer that arrived, and when (a slower one than a poll's deadline is
    #: used by the next poll: the server's own fan-out waits its own call timeout).
    answered: GateAnswer | None = None
    answered_at: float = 0.0

    def __post_init__(self) -> None:
        # vLLM serves its fault-tolerance route at the server's root; each rank its own status.
        root = server_root(self.target.url)
        self.fault_read = FaultRead(self.target.label, root, per_rank=True)

    def labels(self) -> list[str]:
        """One engine per rank once the server named them; the target's label before."""
        if self.ranks:
            return [engine_label(self.target.label, r) for r in self.ranks]
        return [self.target.label]

    def counts_by_label(self) -> dict[str, RequestCounts | None]:
        if not self.ranks:
            return {self.target.label: None}
        return {engine_label(self.target.label, r): self.rank_counts.get(r) for r in self.ranks}

    def forget_counts(self) -> None:
        """No gate answer to read this time: every rank's requests are unknown."""
        self.rank_counts.clear()
        self.counted = None

    def follow(self, answer: GateAnswer, named: list[str]) -> list[str]:
        """Move the ranks by ``answer`` (naming ``named``), once per answer; the labels of
        the engines it dropped (for their per-engine records to be forgotten)."""
        if answer is self.followed:
            return []
        self.followed = answer
        before = self.labels()
        self.absent = follow_ranks(self.absent, named)
        self.ranks = sorted(self.absent, key=int)
        for rank in [r for r in self.rank_counts if r not in self.absent]:
            del self.rank_counts[rank]
        kept = set(self.labels())
        return [label for label in before if label not in kept]


def target_state(target: HttpTarget) -> TargetState:
    """The state of ``target``'s kind: a plugin-enabled server or a dev-routes server."""
    return PluginTargetState(target) if is_plugin_url(target.url) else TargetState(target)
