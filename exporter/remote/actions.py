"""The named admin actions of ``exporter.remote.Client`` (a mixin over its ``action``): one
method per ``POST <admin_url>/admin/<action>``, each with its parameters typed and a timeout that
fits it, so a training script writes ``dp.pause(mode="wait")`` instead of a query. Apart from
the client's transport and reads (``exporter.remote.client``) so that neither module outgrows a
reader.

vLLM 0.34's process checkpoint: ``checkpoint_prepare`` and ``checkpoint_restore`` run on every
rank and are verified by reading each rank's state back. A prepare answers once every rank
started: ``Client.wait(checkpoint="prepared")`` holds once every rank can be captured.
``Unsupported`` (HTTP 501) when no engine has them (vLLM before 0.34, or no engine with sleep
mode: nothing was changed), ``PartialFailure`` naming the ranks that refused, failed or were not
read back where they should be (nothing is rolled back).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

from exporter.remote.results import ActionResult

#: A state-changing action: the exporter's call and its read-back may take --action-timeout
#: (60 s) each.
ACTION_TIMEOUT_S = 150.0
#: The prefix-cache reset (one call, no read-back).
RESET_TIMEOUT_S = 60.0
#: verify_weights: the exporter waits up to --verify-weights-timeout (300 s) for checksums.
VERIFY_TIMEOUT_S = 330.0
#: What an engine may do with running requests while it pauses, sleeps or prepares a
#: checkpoint.
PauseMode = Literal["abort", "wait", "keep"]
WakeTag = Literal["weights", "kv_cache"]


class _Acting(Protocol):
    """What the actions need of their client: ``Client.action``."""

    async def action(
        self,
        name: str,
        params: Mapping[str, str] | None = None,
        body: Mapping[str, Any] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult: ...


class NamedActions:
    """Every admin action by name; each returns the ``ActionResult`` when every engine
    confirmed it and raises as ``Client.action`` does otherwise."""

    async def reset_prefix_cache(
        self: _Acting,
        *,
        reset_running_requests: bool = False,
        reset_connector: bool = False,
        idempotency_key: str | None = None,
        timeout_s: float = RESET_TIMEOUT_S,
    ) -> ActionResult:
        """Reset the prefix cache on every engine (confirmed by each engine's own ``true``)."""
        params = {
            "reset_running_requests": str(reset_running_requests).lower(),
            "reset_connector": str(reset_connector).lower(),
        }
        return await self.action(
            "reset_prefix_cache", params, idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def sleep(
        self: _Acting,
        level: int = 1,
        mode: PauseMode | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """Put every engine to sleep (level 0, 1 or 2); verified by ``is_sleeping``. ``mode``
        is sent only when given (older vLLM takes the level only)."""
        params = {"level": str(level)}
        if mode is not None:
            params["mode"] = mode
        return await self.action(
            "sleep", params, idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def wake_up(
        self: _Acting,
        tags: Sequence[WakeTag] | str | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """Wake every engine up: everything (verified awake), or only ``tags`` (``weights``,
        ``kv_cache``; no read-back unless every tag is named)."""
        joined = tags if isinstance(tags, str) else ",".join(tags or ())
        params = {"tags": joined} if joined else {}
        return await self.action(
            "wake_up", params, idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def pause(
        self: _Acting,
        mode: PauseMode | None = None,
        *,
        clear_cache: bool | None = None,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """Pause every engine's scheduler (the exporter's default mode: abort); verified.
        ``clear_cache=False``: vLLM keeps its caches (and, mode keep, the running requests'
        KV blocks); None sends nothing (vLLM's default: cleared)."""
        params: dict[str, str] = {"mode": mode} if mode is not None else {}
        if clear_cache is not None:
            params["clear_cache"] = "true" if clear_cache else "false"
        return await self.action(
            "pause", params, idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def resume(
        self: _Acting, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        """Resume every engine's scheduler; verified."""
        return await self.action("resume", idempotency_key=idempotency_key, timeout_s=timeout_s)

    async def weight_version(
        self: _Acting,
        version: str,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """Set the weight version on every engine; verified by ``get_weight_version``."""
        return await self.action(
            "weight_version",
            body={"weight_version": version},
            idempotency_key=idempotency_key,
            timeout_s=timeout_s,
        )

    set_weight_version = weight_version

    async def reset_mm_cache(
        self: _Acting, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        """Reset the multi-modal cache on every engine (no state to read back)."""
        return await self.action(
            "reset_mm_cache", idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def reset_encoder_cache(
        self: _Acting, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        """Reset the encoder cache on every engine (no state to read back)."""
        return await self.action(
            "reset_encoder_cache", idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def verify_weights(
        self: _Acting, *, idempotency_key: str | None = None, timeout_s: float = VERIFY_TIMEOUT_S
    ) -> ActionResult:
        """Compare weight checksums across DP ranks: an engine that disagrees with the
        majority fails as ``mismatch`` (its ``mismatching_parameters`` name them)."""
        return await self.action(
            "verify_weights", idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def checkpoint_prepare(
        self: _Acting,
        mode: PauseMode | None = None,
        *,
        idempotency_key: str | None = None,
        timeout_s: float = ACTION_TIMEOUT_S,
    ) -> ActionResult:
        """vLLM 0.34: every rank drains with ``mode`` (None sends nothing: vLLM's ``wait``)
        and releases what a process checkpoint must not hold; verified ``preparing`` or
        ``prepared`` on each. A rank's refusal (asleep, not ``running``) is ``refused``."""
        params = {"mode": mode} if mode is not None else {}
        return await self.action(
            "checkpoint_prepare", params, idempotency_key=idempotency_key, timeout_s=timeout_s
        )

    async def checkpoint_restore(
        self: _Acting, *, idempotency_key: str | None = None, timeout_s: float = ACTION_TIMEOUT_S
    ) -> ActionResult:
        """vLLM 0.34: every rank brings back what preparing released and serves again;
        verified ``restoring`` or ``running`` on each (a rank that ``failed`` cannot)."""
        return await self.action(
            "checkpoint_restore", idempotency_key=idempotency_key, timeout_s=timeout_s
        )
