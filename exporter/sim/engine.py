"""A simulated vLLM engine: the engine side of the engine-core protocol over real ZMQ sockets.

It behaves as ``vllm serve --headless`` does on the wire (HELLO, strict INIT decode, a
registration on every input, READY, utility dispatch with vLLM's failure texts, replies to
``outputs[client_index]``) and has scriptable state and faults for tests and demos. Many engines
can share one process and one event loop, each with its own sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from exporter.error import ProtocolError
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    HELLO,
    READY,
    UTILITY_REQUEST_TYPE,
    decode_init,
    decode_utility_request,
    encode_handshake_message,
    encode_registration,
    encode_utility_reply,
    engine_identity,
    registration_map,
)
from exporter.sim.story import story_state

log = logging.getLogger("exporter.sim")

EXECUTOR_FAILED_TYPE = b"\x04"
PAUSE_MODES = ("abort", "wait", "keep")
ALL_TAGS = frozenset({"weights", "kv_cache"})


class SimStartupError(Exception):
    """The simulated engine aborted its start-up (as a real engine dies on a bad INIT)."""


@dataclass
class SimOptions:
    """State and faults of one simulated engine."""

    sleeping: bool = False
    paused: bool = False
    refuse_reset: bool = False
    reply_delay_s: float = 0.0
    hang: bool = False  # read requests, never answer
    dead_after_calls: int | None = None  # ENGINE_CORE_DEAD after N utility calls, then exit
    exit_after_calls: int | None = None  # silent exit after N utility calls
    shutdown_window_s: float = 0.0  # after stop(): answer "Server shutting down" this long
    drain_s: float = 0.0  # in-flight work that sleep(level, "wait") waits for
    supports_pause_query: bool = True  # False: no is_scheduler_paused (older vLLM)
    vllm_version: str = "0.33.0"
    enable_sleep_mode: bool = True
    handshake_timeout_s: float = 300.0
    story_period_s: float | None = None  # run the demo story (exporter.sim.story)
    story_offset: int = 0
    story_count: int = 1


@dataclass
class SimEngine:
    """One simulated engine; ``await run()`` until it exits."""

    handshake_address: str
    engine_index: int
    options: SimOptions = field(default_factory=SimOptions)
    context: zmq.asyncio.Context | None = None
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        self.sleeping_tags: set[str] = set(ALL_TAGS) if self.options.sleeping else set()
        self.paused = self.options.paused or self.options.sleeping
        self.calls = 0
        self.calls_by_method: dict[str, int] = {}
        self.connected = asyncio.Event()
        self.shutting_down = False
        self.input_alive = True
        self.output_alive = True
        self.init_addresses: tuple[list[str], list[str]] | None = None
        self._outputs: list[zmq.asyncio.Socket] = []
        self._inputs: list[zmq.asyncio.Socket] = []
        self._queue: asyncio.Queue[tuple[int, int, str, list[Any]]] = asyncio.Queue()
        self._stop = asyncio.Event()
        self._exit_reason = "stopped"

    # -- public control ----------------------------------------------------------------------

    def is_sleeping(self) -> bool:
        return self.paused or bool(self.sleeping_tags)

    def stop(self) -> None:
        """Graceful stop (SIGTERM): reject utilities for the shutdown window, then exit."""
        if self.options.shutdown_window_s > 0 and not self.shutting_down:
            self.shutting_down = True
            asyncio.get_running_loop().call_later(self.options.shutdown_window_s, self._stop.set)
        else:
            self._stop.set()

    # -- life cycle ------------------------------------------------------------------------

    async def run(self) -> str:
        """Handshake, serve until stopped; returns why it exited."""
        own = self.context is None
        ctx = self.context or zmq.asyncio.Context()
        try:
            await self._handshake(ctx)
            tasks = [
                asyncio.create_task(self._input_loop(s, i)) for i, s in enumerate(self._inputs)
            ]
            tasks.append(asyncio.create_task(self._busy_loop()))
            if self.options.story_period_s:
                tasks.append(asyncio.create_task(self._story_loop(self.options.story_period_s)))
            self.connected.set()
            try:
                await self._stop.wait()
            finally:
                for task in tasks:
                    task.cancel()
                for task in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            return self._exit_reason
        finally:
            for sock in self._inputs + self._outputs:
                sock.close(linger=0 if self._exit_reason != "dead" else 1000)
            if own:
                ctx.term()

    async def _handshake(self, ctx: zmq.asyncio.Context) -> None:
        identity = engine_identity(self.engine_index)
        hs = ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, identity)
        hs.setsockopt(zmq.LINGER, 5000)
        hs.connect(self.handshake_address)
        try:
            await hs.send(encode_handshake_message(HELLO, local=False, headless=True))
            if not await hs.poll(self.options.handshake_timeout_s * 1000):
                raise SimStartupError("Did not receive response from front-end process")
            try:
                init = decode_init(await hs.recv())
            except ProtocolError as exc:
                raise SimStartupError(f"engine {self.engine_index}: bad INIT: {exc}") from None
            self.init_addresses = (init.addresses.inputs, init.addresses.outputs)
            for address in init.addresses.inputs:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.RCVHWM, 0)
                sock.connect(address)
                self._inputs.append(sock)
            for address in init.addresses.outputs:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 4000)
                sock.connect(address)
                self._outputs.append(sock)
            registration = encode_registration(
                registration_map(
                    self.engine_index,
                    vllm_version=self.options.vllm_version,
                    enable_sleep_mode=self.options.enable_sleep_mode,
                )
            )
            for sock in self._inputs:
                await sock.send(registration)
            await hs.send(encode_handshake_message(READY, local=False, headless=True))
        finally:
            hs.close()

    # -- input thread and busy loop ----------------------------------------------------------

    async def _input_loop(self, sock: zmq.asyncio.Socket, slot: int) -> None:
        while True:
            frames = await sock.recv_multipart()
            request_type = frames[0] if frames else b""
            if request_type == EXECUTOR_FAILED_TYPE:
                # vLLM: the busy loop raises "Executor failed." and the engine dies.
                await self._die("Executor failed.")
                return
            if request_type != UTILITY_REQUEST_TYPE or len(frames) < 2:
                self._kill_input_thread(f"unsupported request type {request_type!r}")
                return
            try:
                request = decode_utility_request(frames[1])
            except ProtocolError as exc:
                self._kill_input_thread(str(exc))
                return
            self._queue.put_nowait(
                (request.client_index, request.call_id, request.method, list(request.args))
            )

    def _kill_input_thread(self, why: str) -> None:
        """A real engine's input thread has no exception handling: it dies, the engine goes mute."""
        log.error("engine %d input thread died: %s", self.engine_index, why)
        self.input_alive = False

    async def _busy_loop(self) -> None:
        while True:
            client_index, call_id, method, args = await self._queue.get()
            self.calls += 1
            self.calls_by_method[method] = self.calls_by_method.get(method, 0) + 1
            if self.options.hang:
                continue
            if self.options.reply_delay_s:
                await asyncio.sleep(self.options.reply_delay_s)
            if self.shutting_down:
                await self._reply(client_index, call_id, failure="Server shutting down")
            else:
                await self._dispatch(client_index, call_id, method, args)
            if self.options.dead_after_calls is not None and (
                self.calls >= self.options.dead_after_calls
            ):
                await self._die("scripted fatal error")
                return
            if self.options.exit_after_calls is not None and (
                self.calls >= self.options.exit_after_calls
            ):
                self._exit_reason = "exited"
                self._stop.set()
                return

    async def _dispatch(
        self, client_index: int, call_id: int, method: str, args: list[Any]
    ) -> None:
        handler = self._methods().get(method)
        if handler is None:
            missing = f"'EngineCoreProc' object has no attribute '{method}'"
            text = f"Call to {method} method failed: {missing}"
            await self._reply(client_index, call_id, failure=text)
            return
        fn, max_args = handler
        if len(args) > max_args:
            await self._reply(client_index, call_id, failure=f"Call to {method} method failed: ")
            return
        try:
            result = fn(*args)
        except ValueError as exc:
            await self._reply(
                client_index, call_id, failure=f"Call to {method} method failed: {exc}"
            )
            return
        if isinstance(result, asyncio.Future):
            # Deferred reply: other utilities are answered meanwhile (replies out of order).
            result.add_done_callback(
                lambda fut: asyncio.ensure_future(
                    self._reply(client_index, call_id, value=fut.result())
                )
            )
            return
        await self._reply(client_index, call_id, value=result)

    def _methods(self) -> dict[str, tuple[Callable[..., Any], int]]:
        methods: dict[str, tuple[Callable[..., Any], int]] = {
            "is_sleeping": (self.is_sleeping, 0),
            "sleep": (self._sleep, 2),
            "wake_up": (self._wake_up, 1),
            "reset_prefix_cache": (self._reset_prefix_cache, 2),
            "pause_scheduler": (self._pause_scheduler, 2),
            "resume_scheduler": (self._resume_scheduler, 0),
        }
        if self.options.supports_pause_query:
            methods["is_scheduler_paused"] = (lambda: self.paused, 0)
        return methods

    def _pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Any:
        if mode not in PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode}")
        self.paused = True
        if mode == "wait" and self.options.drain_s > 0:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_later(self.options.drain_s, future.set_result, None)
            return future
        return None

    def _sleep(self, level: int = 1, mode: str = "abort") -> Any:
        deferred = self._pause_scheduler(mode, clear_cache=level >= 1)
        if level >= 1:
            self.sleeping_tags = set(ALL_TAGS)
        return deferred

    def _wake_up(self, tags: list[str] | None = None) -> bool:
        # None wakes whatever is asleep; named tags that are not all asleep are ignored (a no-op).
        wanted = set(self.sleeping_tags) if tags is None else {t for t in tags if t != "scheduling"}
        if wanted <= self.sleeping_tags:
            self.sleeping_tags -= wanted
        if not self.sleeping_tags:
            self.paused = False
            return True
        return False

    def _resume_scheduler(self) -> None:
        self.paused = False

    def _reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return not self.options.refuse_reset

    # -- output thread -------------------------------------------------------------------------

    async def _reply(
        self, client_index: int, call_id: int, *, value: Any = None, failure: str | None = None
    ) -> None:
        if not self.output_alive:
            return
        if not 0 <= client_index < len(self._outputs):
            # vLLM indexes outputs[client_index] unchecked: the output thread dies.
            log.error(
                "engine %d output thread died: client_index %d", self.engine_index, client_index
            )
            self.output_alive = False
            return
        frame = encode_utility_reply(
            self.engine_index, call_id, value=value, failure_message=failure, timestamp=self.clock()
        )
        await self._outputs[client_index].send(frame)

    async def _die(self, why: str) -> None:
        log.error("engine %d died: %s", self.engine_index, why)
        for sock in self._outputs:
            await sock.send(ENGINE_CORE_DEAD)
        self._exit_reason = "dead"
        self._stop.set()

    async def _story_loop(self, period_s: float) -> None:
        while True:
            # Wall-clock time: engines in different processes share the story's phase.
            state = story_state(
                self.options.story_offset, self.options.story_count, time.time(), period_s
            )
            self.options.refuse_reset = state.refuse_reset
            if state.sleeping:
                self.sleeping_tags = set(ALL_TAGS)
            elif self.sleeping_tags:
                self.sleeping_tags.clear()
            self.paused = state.paused or state.sleeping
            await asyncio.sleep(min(0.2, period_s / 50))
