"""``PushBook``: what each engine said unasked (fault-tolerance status, elastic-EP membership
events), kept per engine for the layers above.

Owner mode receives the pushes itself (the exporter is client 0); in-process and HTTP mode
learn the same statuses from vLLM's front end and record them here too, so every mode shows
one thing the same way. A status is kept until the engine's next handshake (a restarted
engine starts healthy and pushes only on change), across an exporter restart too (owner mode's
state file). A status that cannot be read (no map, no string) is recorded as ``unknown`` and
counted as ``bad_push`` (``bad_fault_tolerance_status`` where read from the front end): never
healthy, never dropped. A status string this exporter does not know is readable: ``other``,
not counted (``exporter.protocol.pushes.read_rank_status``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from exporter.base.faults import ProtocolErrorTally
from exporter.error import ProtocolError
from exporter.protocol.pushes import FT_STATE_VALUES as FT_STATE_VALUES  # for the layers above
from exporter.protocol.pushes import FT_UNKNOWN as FT_UNKNOWN  # for the layers above
from exporter.protocol.pushes import (
    PUSH_EEP,
    PUSH_FT_STATUS,
    FaultStatus,
    RankStatus,
    decode_eep_notification,
    decode_ft_status,
    push_kind,
)
from exporter.protocol.pushes import MembershipEvent as MembershipEvent  # for the layers above

log = logging.getLogger("exporter.client")
#: At most one log line per engine this often (a broken or hostile engine can push thousands a
#: second; every push is still counted and the last status kept).
LOG_INTERVAL_S = 10.0
PUSH_BAD = "bad_push"
#: How a status read from vLLM's front end (in-process, HTTP) that cannot be read is counted.
BAD_FT_STATUS = "bad_fault_tolerance_status"


class PushBook:
    """Per engine: the last fault-tolerance status, the last membership event, push counts."""

    def __init__(
        self, faults: ProtocolErrorTally, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._faults = faults
        self._clock = clock
        self.fault_status: dict[str, FaultStatus] = {}
        self.membership: dict[str, MembershipEvent] = {}
        #: (engine, kind) → pushes received.
        self.counts: Counter[tuple[str, str]] = Counter()
        self._logged: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def on_push(self, engine: str, engine_index: int, call_id: int, value: object) -> bool:
        """One utility output with a negative call id from ``engine_index``'s connection;
        True when it changed what the engine's status or last event is."""
        kind = push_kind(call_id)
        self.counts[(engine, kind)] += 1
        try:
            if kind == PUSH_FT_STATUS:
                return self.record(engine, decode_ft_status(value, engine_index))
            if kind == PUSH_EEP:
                return self._on_membership(engine, engine_index, value)
        except ProtocolError as exc:
            self._faults.record(exc.kind, f"engine {engine}: {exc}")
        return False

    def _on_membership(self, engine: str, engine_index: int, value: object) -> bool:
        """An elastic-EP notification is the sender's, the engine whose connection carried it;
        the DP rank it names is kept as reported (``reported_rank``): vLLM names its config's
        rank, 0 on a dense engine, and a MoE engine's new rank after a reconfiguration."""
        event, rank = decode_eep_notification(value)
        now = self._clock()
        self.membership[engine] = MembershipEvent(event, engine_index, engine, now, rank)
        self._log(engine, logging.INFO, "elastic-EP %s (its config names DP rank %d)", event, rank)
        return True

    def record(self, engine: str, read: RankStatus, kind: str = PUSH_BAD) -> bool:
        """Record one status read by the one rule (``read_rank_status``); one that could not be
        read is recorded as ``unknown`` and counted (``kind``: ``bad_push`` for a push,
        ``bad_fault_tolerance_status`` for the front end's table). True when it changed."""
        if read.problem is not None:
            self._faults.record(kind, f"engine {engine}: fault-tolerance status {read.problem}")
        return self.set_fault_status(engine, read.status, read.fault_info)

    def set_unknown(self, engine: str, why: str) -> bool:
        """The engine's status is not known (fail closed: not healthy); True when it changed."""
        return self.set_fault_status(engine, FT_UNKNOWN, why)

    def restore(self, engine: str, status: FaultStatus) -> None:
        """A status a previous exporter process recorded (owner mode's state file), with its
        own ``since_unix``."""
        self.fault_status[engine] = status

    def set_fault_status(self, engine: str, status: str, fault_info: str | None) -> bool:
        """Record ``engine``'s status; ``since_unix`` moves only when the status changes.
        True when it changed."""
        last = self.fault_status.get(engine)
        if last is not None and (last.status, last.fault_info) == (status, fault_info):
            return False
        self.fault_status[engine] = FaultStatus(status, fault_info, self._clock())
        level = logging.WARNING if status != "healthy" else logging.INFO
        why = f" ({fault_info})" if fault_info else ""
        self._log(engine, level, "fault tolerance %s%s", status, why)
        return True

    def _log(self, engine: str, level: int, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._logged.get(engine, -LOG_INTERVAL_S) < LOG_INTERVAL_S:
            self._suppressed[engine] = self._suppressed.get(engine, 0) + 1
            return
        self._logged[engine] = now
        more = self._suppressed.pop(engine, 0)
        suffix = f" ({more} more since the last line)" if more else ""
        log.log(level, f"engine %s: {message}%s", engine, *args, suffix)

    def forget(self, engine: str) -> None:
        """A new handshake: the engine starts over (healthy, no event)."""
        self.fault_status.pop(engine, None)
        self.membership.pop(engine, None)

    def drop(self, engine: str) -> None:
        """The engine left the fleet (a rank a plugin-enabled server stopped naming): nothing
        of it is kept, its counts included."""
        self.forget(engine)
        for key in [k for k in self.counts if k[0] == engine]:
            del self.counts[key]
        self._logged.pop(engine, None)
        self._suppressed.pop(engine, None)

    def counts_of(self, engine: str) -> dict[str, int]:
        return {kind: n for (e, kind), n in self.counts.items() if e == engine}
