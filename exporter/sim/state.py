"""The simulated engine's state machine: what vLLM's ``EngineCore`` utility methods do to its
sleep and pause state, with vLLM's failure texts.

Pure: no sockets, no event loop, no clock. A result that is only ready later (``sleep`` or
``pause_scheduler`` with mode ``"wait"`` while in-flight work drains) is returned as a
:class:`Deferred`; whoever drives the state (the ZMQ engine in ``exporter.sim.engine``, the API
server in ``exporter.sim.api_server``) schedules it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from exporter.sim.story import StoryState

PAUSE_MODES = ("abort", "wait", "keep")
ALL_TAGS = frozenset({"weights", "kv_cache"})


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
    """Sleep and pause state of one engine, and the utility methods that change it.

    ``sleeping_tags``, ``paused`` and ``refuse_reset`` are the state (tests may set them);
    ``drain_s`` and ``supports_pause_query`` are fixed behaviour.
    """

    sleeping_tags: set[str] = field(default_factory=set)
    paused: bool = False
    refuse_reset: bool = False  # reset_prefix_cache returns False (blocks still held)
    drain_s: float = 0.0  # in-flight work that pause/sleep with mode "wait" waits for
    supports_pause_query: bool = True  # False: no is_scheduler_paused (older vLLM)

    @classmethod
    def initial(
        cls,
        *,
        sleeping: bool = False,
        paused: bool = False,
        refuse_reset: bool = False,
        drain_s: float = 0.0,
        supports_pause_query: bool = True,
    ) -> EngineState:
        """A fresh engine; ``sleeping`` means asleep at level 1 (every tag, scheduler paused)."""
        return cls(
            sleeping_tags=set(ALL_TAGS) if sleeping else set(),
            paused=paused or sleeping,
            refuse_reset=refuse_reset,
            drain_s=drain_s,
            supports_pause_query=supports_pause_query,
        )

    # -- queries -------------------------------------------------------------------------------

    def is_sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: true while anything sleeps or the scheduler is paused."""
        return self.paused or bool(self.sleeping_tags)

    def is_scheduler_paused(self) -> bool:
        return self.paused

    # -- utility methods -----------------------------------------------------------------------

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Deferred | None:
        """Pause; with mode ``"wait"`` the answer comes once in-flight work drained."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self.paused = True
        if mode == "wait" and self.drain_s > 0:
            return Deferred(self.drain_s)
        return None

    def resume_scheduler(self) -> None:
        self.paused = False

    def sleep(self, level: int = 1, mode: str = "abort") -> Deferred | None:
        """Level 0 only pauses the scheduler; level 1 and 2 also put every tag to sleep."""
        deferred = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level >= 1:
            self.sleeping_tags = set(ALL_TAGS)
        return deferred

    def wake_up(self, tags: Sequence[str] | None = None) -> bool:
        """Wake ``tags`` (None: whatever sleeps); true once nothing sleeps (scheduler resumed).

        Named tags that are not all asleep are ignored (a no-op), as is ``"scheduling"``.
        """
        wanted = set(self.sleeping_tags) if tags is None else {t for t in tags if t != "scheduling"}
        if wanted <= self.sleeping_tags:
            self.sleeping_tags -= wanted
        if not self.sleeping_tags:
            self.paused = False
            return True
        return False

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return not self.refuse_reset

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
        }
        if self.supports_pause_query:
            methods["is_scheduler_paused"] = (self.is_scheduler_paused, 0)
        return methods

    def call(self, method: str, args: Sequence[Any] = ()) -> Any:
        """Run one utility call; returns its value (maybe a :class:`Deferred`), raises
        :class:`UtilityFailure` with vLLM's text for an unknown method, too many arguments
        or a rejected argument."""
        entry = self.methods().get(method)
        if entry is None:
            raise UtilityFailure(method, f"'EngineCoreProc' object has no attribute '{method}'")
        fn, max_args = entry
        if len(args) > max_args:
            raise UtilityFailure(method, "")
        try:
            return fn(*args)
        except ValueError as exc:
            raise UtilityFailure(method, str(exc)) from None

    # -- the demo story ------------------------------------------------------------------------

    def apply_story(self, story: StoryState) -> None:
        """Take the state the demo story (``exporter.sim.story``) wants right now."""
        self.refuse_reset = story.refuse_reset
        self.sleeping_tags = set(ALL_TAGS) if story.sleeping else set()
        self.paused = story.paused or story.sleeping
