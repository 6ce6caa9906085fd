"""What each rank is doing, as far as its answers tell (pure): hung is not slow, and whether a
router should send it traffic.

A rank whose connection is alive but that has answered no utility call for ``hung_after``
seconds is **hung** (a wedged collective, a stuck kernel: vLLM's ``/health`` stays 200); one
late answer is only a timeout. A rank is **routable** when it answered the last poll, is not
hung, is awake and not paused, and no fault-tolerance status says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.client.fleet import Outcome
from exporter.fleetstate.snapshot import EngineSnapshot

#: The automatic ``--hung-after`` (0): this many poll intervals without an answer.
HUNG_AFTER_POLLS = 3


def hung_after_s(setting: float, poll_interval_s: float, call_timeout_s: float) -> float:
    """``--hung-after`` in effect: the setting, or (0) three poll intervals, never below the
    call timeout (a rank is never hung before one of its calls could time out)."""
    if setting > 0:
        return setting
    return max(HUNG_AFTER_POLLS * poll_interval_s, call_timeout_s)


@dataclass(frozen=True, slots=True)
class Routability:
    """One rank's verdict for routers: routable, or not with the reasons."""

    routable: bool
    reasons: tuple[str, ...] = ()


def routability(engine: EngineSnapshot) -> Routability:
    """Whether ``engine`` should take traffic now, from the last poll (pure)."""
    reasons: list[str] = []
    if not engine.detail.connected:
        reasons.append("disconnected")
    if engine.hung:
        reasons.append(f"hung: no answer for {engine.unresponsive_s:.0f} s")
    sleeping = engine.sleeping_outcome
    if sleeping is not None and sleeping.outcome is Outcome.INCONSISTENT:
        # An HTTP target answered, but its own ranks disagree: some may be asleep or paused.
        reasons.append("its ranks disagree (inconsistent)")
    elif sleeping is None or not sleeping.ok:
        why = sleeping.outcome.value if sleeping is not None else "not asked"
        reasons.append(f"no answer in the last poll ({why})")
    elif engine.state in ("paused", "asleep"):  # as the state reads (paused wins, as vLLM's)
        reasons.append(engine.state)
    ft = engine.detail.fault_status
    if ft is not None and ft.faulty:
        info = f" ({ft.fault_info})" if ft.fault_info else ""
        reasons.append(f"fault tolerance: {ft.status}{info}")
    return Routability(not reasons, tuple(dict.fromkeys(reasons)))
