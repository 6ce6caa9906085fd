"""``FakeFleet`` variants for the unit tier: engines that report fault-tolerance statuses or
handshake again, and a fleet whose calls wait until the test lets them through."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import EngineDetail, EngineOutcome
from exporter.protocol.pushes import FaultStatus


def awake(
    engines: Collection[str],
    version: str | None = "v1",
    changed: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``answers`` of engines awake, not paused, at weight ``version``; ``changed`` overrides
    some engines' answers (``{"1": {"is_sleeping": True}}``)."""
    base = {
        "is_sleeping": False,
        "is_scheduler_paused": False,
        "get_weight_version": version,
        "has_work": False,
        "checkpoint_state": ["running", None],  # vLLM 0.34's
    }
    return {e: {**base, **(changed or {}).get(e, {})} for e in engines}


@dataclass
class ReportingFleet(FakeFleet):
    """A ``FakeFleet`` whose engines carry what they pushed (``fault_status``) and how often
    they handshook (``handshakes``, 1 by default), both changed by the test."""

    fault_status: dict[str, FaultStatus] = field(default_factory=dict)
    handshakes: dict[str, int] = field(default_factory=dict)

    def engine_details(self) -> list[EngineDetail]:
        return [
            dataclasses.replace(
                d,
                fault_status=self.fault_status.get(d.engine),
                handshakes=self.handshakes.get(d.engine, d.handshakes),
            )
            for d in super().engine_details()
        ]


@dataclass
class HeldFleet(FakeFleet):
    """A ``FakeFleet`` whose calls wait for ``release``: ``entered`` is set once a call is
    waiting, so a test acts while a fan-out is in flight without sleeping."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    entered: asyncio.Event = field(default_factory=asyncio.Event)

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        self.entered.set()
        await self.release.wait()
        return await super().call_utility(method, args, timeout_s=timeout_s, engines=engines)


def fleet_of(values: Mapping[str, Mapping[str, Any]], **options: Any) -> FakeFleet:
    """A ``FakeFleet`` over fixed ``answers`` (engines in the order given)."""
    per_engine = {e: dict(v) for e, v in values.items()}
    return FakeFleet(answers(per_engine), engines=tuple(values), **options)
