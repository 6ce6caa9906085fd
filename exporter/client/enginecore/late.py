"""Late replies: a reply to a utility call the client gave up on (it timed out) is a busy or
recovering engine answering its queue (a faulted vLLM 0.34 engine answers every queued call once
it recovers), not a protocol error. The client remembers the last ``MAX_GIVEN_UP`` calls it gave
up on, and counts each late reply once, on the engine that sent it."""

from __future__ import annotations

from collections import Counter, OrderedDict

#: Calls that timed out remembered per client (the oldest forgotten first).
MAX_GIVEN_UP = 4096
#: The family the late replies are published as (``vllm_dp_late_replies_total{engine}``).
LATE_REPLIES = "vllm_dp_late_replies_total"


class LateReplies:
    """Calls given up on, and the late replies counted per engine label."""

    def __init__(self, limit: int | None = None) -> None:
        self._limit = limit
        self._given_up: OrderedDict[int, int] = OrderedDict()
        #: Engine label → its late replies.
        self.counts: Counter[str] = Counter()

    def give_up(self, call_id: int, engine_index: int) -> None:
        """No answer came in time for ``call_id``, sent to ``engine_index``."""
        self._given_up[call_id] = engine_index
        if len(self._given_up) > (self._limit or MAX_GIVEN_UP):
            self._given_up.popitem(last=False)

    def claim(self, call_id: int, engine_index: int, label: str) -> bool:
        """Whether a reply with no pending call is a late one (counted, then forgotten: the
        same id again is not); a reply from another engine than the one asked never is."""
        if self._given_up.get(call_id) != engine_index:
            return False
        del self._given_up[call_id]
        self.counts[label] += 1
        return True
