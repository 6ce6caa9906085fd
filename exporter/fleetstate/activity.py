"""What each rank is doing, as far as its answers tell (pure): hung is not slow, and whether a
router should send it traffic.

A rank whose connection is alive but that has answered no utility call for ``hung_after``
seconds is **hung** (a wedged collective, a stuck kernel: vLLM's ``/health`` stays 200); one
late answer is only a timeout. A rank is **routable** when it answered the last poll, is not
hung or stalled, is awake and not paused, and no fault-tolerance status says otherwise.

A rank that answers every call but computes nothing is **stalled**: it holds requests, says it
has work (``has_work`` true: the engine's own answer this poll, never a stale record), is awake
and not paused, and it has computed no token (``RankProgress``) for ``--stall-after`` seconds
since it got that work (a rank idle for an hour is not stalled by its next request's first
prefill). Only a source that counts the rank's tokens as it steps can tell (in-process mode:
vLLM's stat loggers); where none does, a rank is never stalled.

Answers older than a running poller ever leaves them (``stale_after_s``: a poll held up, a
poller that stopped) route nothing: every rank reads **stale** and not routable until a poll
completes again (fail closed: an old "routable" is not a health signal).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from exporter.client.fleet import Outcome
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot
from exporter.protocol.progress import RankProgress

#: The progress sources that count a rank's tokens as it steps (``RankProgress.source``). HTTP
#: mode's ``/metrics`` counters are not one for this: the request gauges beside them are
#: refreshed only while the engine steps, so a rank that stopped stepping can show requests it
#: no longer holds.
STALL_SOURCES = frozenset({"stat_logger"})

#: The automatic ``--hung-after`` (0): this many poll intervals without an answer.
HUNG_AFTER_POLLS = 3
#: Seconds beyond the longest a running poller takes before its snapshot reads stale.
STALE_MARGIN_S = 5.0


def hung_after_s(setting: float, poll_interval_s: float, call_timeout_s: float) -> float:
    """``--hung-after`` in effect: the setting, or (0) three poll intervals, never below the
    call timeout (a rank is never hung before one of its calls could time out)."""
    if setting > 0:
        return setting
    return max(HUNG_AFTER_POLLS * poll_interval_s, call_timeout_s)


def stale_after_s(poll_interval_s: float, call_timeout_s: float) -> float:
    """How old the last poll's snapshot grows while the poller runs: the next poll starts an
    interval (and its jitter) after it and takes at most its spread over the interval, a call
    timeout, and one more for a paced poll's confirming read. Twice the interval and the call
    timeout, and ``STALE_MARGIN_S`` for a loaded machine; older, no poll is coming."""
    return 2 * (poll_interval_s + call_timeout_s) + STALE_MARGIN_S


def marked_stale(snap: FleetSnapshot, now_unix: float, stale_after: float) -> FleetSnapshot | None:
    """``snap`` with each engine's ``stale_s`` set to its age in whole seconds, when it is older
    than ``stale_after`` and not already marked with that age; None otherwise (pure)."""
    age = now_unix - snap.taken_at_unix
    if not snap.taken_at_unix or not age > stale_after:
        return None
    whole = float(int(age))
    if all(e.stale_s == whole for e in snap.engines):
        return None
    engines = tuple(dataclasses.replace(e, stale_s=whole) for e in snap.engines)
    return dataclasses.replace(snap, engines=engines)


@dataclass(frozen=True, slots=True)
class Routability:
    """One rank's verdict for routers: routable, or not with the reasons."""

    routable: bool
    reasons: tuple[str, ...] = ()


def held_without_progress(
    progress: RankProgress | None, now_unix: float, stall_after_s: float
) -> bool:
    """The part of the stall rule ``progress`` alone decides (pure): its rank holds requests
    the source counts and computed no token for ``stall_after_s``. A listening poll asks such
    a rank ``has_work`` itself (``FleetRead``), so it reads stalled only on its own answer."""
    if stall_after_s <= 0 or progress is None or progress.source not in STALL_SOURCES:
        return False
    # The requests whose tokens the source counts (several API servers: each counts its own).
    if not progress.held:
        return False
    # The clock starts at the later of the last token and the moment the rank got this work.
    return progress.stall_age_s(now_unix) >= stall_after_s


def is_stalled(
    engine: EngineSnapshot, progress: RankProgress | None, now_unix: float, stall_after_s: float
) -> bool:
    """Whether ``engine`` (this poll's answers) is stalled by ``progress`` (pure)."""
    if not held_without_progress(progress, now_unix, stall_after_s):
        return False
    # hung, unknown, paused or asleep: that state wins; and the engine says it has work.
    return engine.has_work is True and engine.state == "awake"


def routability(engine: EngineSnapshot) -> Routability:
    """Whether ``engine`` should take traffic now, from the last poll (pure)."""
    reasons: list[str] = []
    if engine.stale_s > 0:  # no poll for longer than a running poller takes: fail closed
        reasons.append(f"stale: no poll for {engine.stale_s:.0f} s")
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
    elif engine.stalled:
        age = engine.progress_age_s or 0.0
        reasons.append(f"stalled: holds requests, no token computed for {age:.0f} s")
    ft = engine.detail.fault_status
    if ft is not None and ft.faulty:
        info = f" ({ft.fault_info})" if ft.fault_info else ""
        reasons.append(f"fault tolerance: {ft.status}{info}")
    return Routability(not reasons, tuple(dict.fromkeys(reasons)))
