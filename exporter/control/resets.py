"""Which engines an admin action confirmed a prefix-cache reset on (pure).

A router's KV index learns of a reset from the rank's ``AllBlocksCleared`` event, which vLLM
queues at the reset but publishes only with the next scheduler step's events: a paused,
sleeping or idle engine does not send it, and a lossy subscriber may miss it. The exporter
sees the reset itself, so it records per engine when it was confirmed
(``vllm_dp_prefix_cache_last_reset_timestamp_seconds``, ``/status``), for every action that
resets the cache:

* ``reset_prefix_cache``: confirmed by the engine's own ``True`` (``False`` is a refusal);
* ``pause_scheduler`` (``clear_cache`` true, vLLM's default and what the pause action sends) and
  ``sleep`` at level 1 or 2: vLLM 0.32 and 0.33 end the pause with
  ``EngineCore._reset_caches`` (``reset_prefix_cache(True, True)``, and a RuntimeError that
  fails the call when it returns False), so an accepted call is a confirmed reset; the state
  read back afterwards (``unverified``) does not change that. Only for engines whose
  registered vLLM version is one read for this (:data:`RESETTING_RELEASES`): a newer vLLM
  may stop resetting on sleep (vLLM PR #53082), and one without a version is not assumed to.

A call that timed out, failed or was refused is never counted, even though the engine may have
reset: the exporter claims only what the engine confirmed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from exporter.control.parsing import ActionRequest
from exporter.control.verdicts import ActionVerdict

#: vLLM releases (major, minor) whose pause and sleep (level >= 1) reset the prefix cache, read
#: in their source (``vllm/v1/engine/core.py``: ``_finish_pause`` → ``_reset_caches``).
RESETTING_RELEASES = frozenset({(0, 32), (0, 33)})
_RELEASE = re.compile(r"v?(\d+)\.(\d+)")
#: Reasons of an engine whose call was accepted (only the read-back disagreed).
ACCEPTED = (None, "unverified")


def release_of(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a vLLM version string (``0.33.0``, ``0.32.1rc1+cpu``), else None."""
    match = _RELEASE.match(version or "")
    return (int(match[1]), int(match[2])) if match else None


def reset_kind(request: ActionRequest) -> str | None:
    """``"explicit"`` (the engine says True when it reset), ``"implied"`` (an accepted call
    resets the cache on the releases read) or None (the action does not reset it)."""
    args = request.args
    if request.method == "reset_prefix_cache":
        return "explicit"
    if request.method == "pause_scheduler":
        clear_cache = args[1] if len(args) > 1 else True
        return "implied" if clear_cache is True else None
    if request.method == "sleep":
        level = args[0] if args else 1
        return "implied" if isinstance(level, int) and level >= 1 else None
    return None


def confirmed_resets(
    request: ActionRequest, verdict: ActionVerdict, versions: Mapping[str, str | None]
) -> list[str]:
    """The engines of ``verdict`` that confirmed a prefix-cache reset (``versions``: each
    engine's registered vLLM version)."""
    kind = reset_kind(request)
    if kind == "explicit":
        return [e.engine for e in verdict.engines if e.reason is None]
    if kind == "implied":
        return [
            e.engine
            for e in verdict.engines
            if e.reason in ACCEPTED and release_of(versions.get(e.engine)) in RESETTING_RELEASES
        ]
    return []
