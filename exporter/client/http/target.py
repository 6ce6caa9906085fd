"""One HTTP-mode target and what the client knows of it (``exporter.client.http.client``):
whether it answered, its vLLM version, and for a plugin-enabled server (URL ending in ``/dp``)
the ranks its ``/dp/gate`` answers name, followed answer by answer (``plugin.follow_ranks``) so
a target holds at most ``MAX_ENGINES`` engines and none its server stopped naming.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from exporter.client.http.fault import FaultRead
from exporter.client.http.plugin import GateAnswer, engine_label, follow_ranks, server_root


@dataclass(frozen=True, slots=True)
class HttpTarget:
    """One vLLM API server: its engine label and its base URL (no trailing slash)."""

    label: str
    url: str


@dataclass(slots=True)
class TargetState:
    target: HttpTarget
    connected: bool = False
    requests: int = 0
    #: From ``GET /version``, asked once the target answers (for ``vllm_dp_engine_info``).
    vllm_version: str | None = None
    version_pending: bool = False
    #: A plugin-enabled server (URL ending in /dp): its engines' ranks, once it named them.
    plugin: bool = False
    ranks: list[str] = field(default_factory=list)
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
    #: ``GET /fault_tolerance/status`` (``fault``): at the server's root for a plugin target.
    fault_read: FaultRead = field(init=False)

    def __post_init__(self) -> None:
        root = server_root(self.target.url) if self.plugin else self.target.url
        self.fault_read = FaultRead(self.target.label, root, per_rank=self.plugin)

    def labels(self) -> list[str]:
        """This target's engine labels: one per engine of a plugin target, once known."""
        if self.plugin and self.ranks:
            return [engine_label(self.target.label, r) for r in self.ranks]
        return [self.target.label]

    def follow(self, answer: GateAnswer, named: list[str]) -> list[str]:
        """Move the ranks by ``answer`` (naming ``named``), once per answer; the labels of
        the engines it dropped (for their per-engine records to be forgotten)."""
        if answer is self.followed:
            return []
        self.followed = answer
        before = self.labels()
        self.absent = follow_ranks(self.absent, named)
        self.ranks = sorted(self.absent, key=int)
        kept = set(self.labels())
        return [label for label in before if label not in kept]
