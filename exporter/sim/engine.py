"""A simulated vLLM engine: the engine side of the engine-core protocol over real ZMQ sockets.

It behaves as ``vllm serve --headless`` does on the wire (HELLO, strict INIT decode, a
registration on every input, READY, utility dispatch with vLLM's failure texts, replies to
``outputs[client_index]``) and has scriptable state and faults for tests and demos. Many engines
can share one process and one event loop, each with its own sockets.

This module is the wire side only: every utility method is run by the engine's
:class:`~exporter.sim.state.EngineState` (``engine.state``), the pure state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

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
from exporter.protocol.kv_events import publisher_config
from exporter.protocol.pushes import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    encode_ft_status_value,
)
from exporter.protocol.utility import encode_notifications_output
from exporter.sim.options import OutputHook, RequestHook, SimOptions
from exporter.sim.state import Deferred, EngineState, UtilityFailure
from exporter.sim.story import StoryState, run_story

log = logging.getLogger("exporter.sim")
#: How often a frozen engine (``SimOptions.frozen``) looks whether it was thawed.
FROZEN_CHECK_S = 0.02

EXECUTOR_FAILED_TYPE = b"\x04"
#: What a coordinated (MoE) DP engine reports: its DP size in the registration and, in READY,
#: the hash of its parallel config (the same on every engine of the fleet).
COORDINATED_DP_SIZE = 2
PARALLEL_CONFIG_HASH = hashlib.sha256(b"exporter.sim parallel_config dp=2").hexdigest()


class SimStartupError(Exception):
    """The simulated engine aborted its start-up (as a real engine dies on a bad INIT)."""


@dataclass
class SimEngine:
    """One simulated engine; ``await run()`` until it exits.

    ``on_request`` (a :data:`RequestHook`, settable at any time) sees every utility request the
    engine answers, in the order it answers them, after the wire-side faults (``hang``,
    ``reply_delay_s``, the shutdown window) and before the state machine runs it; returning a
    :class:`SimReply` answers with that instead. Tests record requests and script answers with
    it; it is never called for a request the engine does not answer. ``on_output`` (an
    :data:`OutputHook`, settable at any time) sees every output frame once it is sent.
    """

    handshake_address: str
    engine_index: int
    options: SimOptions = field(default_factory=SimOptions)
    context: zmq.asyncio.Context | None = None
    clock: Callable[[], float] = time.monotonic
    on_request: RequestHook | None = None
    on_output: OutputHook | None = None

    def __post_init__(self) -> None:
        #: Sleep/pause/weight state and every utility method (the options' state fields are
        #: read once, here; the engine index is its DP rank).
        self.state: EngineState = self.options.initial_state(self.engine_index)
        self.calls = 0
        self.calls_by_method: dict[str, int] = {}
        #: Utility replies sent so far (each after its frame went out; pushes are not replies):
        #: with ``calls``, what tells a test that every request read has been answered.
        self.replies = 0
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
        self._deferred: set[asyncio.TimerHandle] = set()
        self._replies: set[asyncio.Task[None]] = set()

    # -- public control ----------------------------------------------------------------------

    def stop(self) -> None:
        """Graceful stop (SIGTERM): reject utilities for the shutdown window, then exit."""
        if self.options.shutdown_window_s > 0 and not self.shutting_down:
            self.shutting_down = True
            asyncio.get_running_loop().call_later(self.options.shutdown_window_s, self._stop.set)
        else:
            self._stop.set()

    async def push(self, call_id: int, value: Any, *, client_index: int = 0) -> None:
        """Send ``value`` unasked to client 0 with a reserved call id, as vLLM 0.33's
        fault-tolerance sentinel (``FT_STATUS_CALL_ID``, ``encode_ft_status_value``) and
        elastic-EP notifications (``notify_elastic_ep``) do; another ``client_index`` is a
        robustness case (no vLLM sends it there)."""
        if self.output_alive and 0 <= client_index < len(self._outputs):
            frame = encode_utility_reply(
                self.engine_index,
                call_id,
                value=value,
                timestamp=self.clock(),
                engine_notifications=self.options.engine_notifications,
            )
            await self._send(client_index, frame)

    @property
    def data_parallel_rank(self) -> int:
        """``parallel_config.data_parallel_rank`` as vLLM's ``run_engine_core`` leaves it (see
        ``SimOptions.data_parallel_rank``): not the engine index on a dense engine."""
        rank = self.options.data_parallel_rank
        if rank is not None:
            return rank
        return self.engine_index if self.options.coordinated_dp else 0

    async def notify_elastic_ep(self, event: str, *, client_index: int = 0) -> None:
        """``DPEngineCoreProc._eep_send_engine_core_notification``: ``[event,
        data_parallel_rank]`` under the sender's own ``engine_index``."""
        value = [event, self.data_parallel_rank]
        await self.push(EEP_NOTIFICATION_CALL_ID, value, client_index=client_index)

    async def push_fault_status(self, status: str, fault_info: str | None = None) -> None:
        """The sentinel's push of ``status`` (``encode_ft_status_value``): vLLM 0.33's three,
        PR #41438's ``paused`` and ``recovering``, or any other string."""
        value = encode_ft_status_value(self.engine_index, status, fault_info)
        await self.push(FT_STATUS_CALL_ID, value)

    async def notify(self, engine_notifications: Any) -> None:
        """Send every client an output with no utility reply and only ``engine_notifications``,
        as an engine with vLLM PR #51433 broadcasts its notifications (``custom_notification``
        entries)."""
        if self.output_alive:
            frame = encode_notifications_output(
                self.engine_index, engine_notifications, timestamp=self.clock()
            )
            for client_index in range(len(self._outputs)):
                await self._send(client_index, frame)

    async def _push_fault(self, status: str) -> None:
        await self.push_fault_status(status, "RuntimeError" if status == "unhealthy" else None)

    def _apply_story(self, story: StoryState, now: float) -> None:
        """The demo story's state, and its hung window (requests read, never answered)."""
        self.state.apply_story(story, now)
        self.options.hang = story.hung

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
            period = self.options.story_period_s
            if period:
                story = run_story(
                    self._apply_story,
                    self.options.story_offset,
                    self.options.story_count,
                    period,
                    self._push_fault,
                )
                tasks.append(asyncio.create_task(story))
            self.connected.set()
            try:
                await self._stop.wait()
            finally:
                for handle in self._deferred:
                    handle.cancel()
                for task in [*tasks, *self._replies]:
                    task.cancel()
                for task in [*tasks, *self._replies]:
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
        _connect(hs, self.handshake_address)
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
                _connect(sock, address)
                self._inputs.append(sock)
            for address in init.addresses.outputs:
                sock = ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 0)
                sock.setsockopt(zmq.LINGER, 4000)
                _connect(sock, address)
                self._outputs.append(sock)
            opts, coordinated = self.options, self.options.coordinated_dp
            fields = registration_map(
                self.engine_index,
                vllm_version=opts.vllm_version,
                enable_sleep_mode=opts.enable_sleep_mode,
                data_parallel_size=COORDINATED_DP_SIZE if coordinated else 1,
                kv_events_config=publisher_config(opts.kv_events, self.engine_index),
                keys=opts.registration_keys,
            )
            registration = encode_registration({**fields, **(opts.registration_extra or {})})
            for sock in self._inputs:
                await sock.send(registration)
            extra = {"parallel_config_hash": PARALLEL_CONFIG_HASH} if coordinated else {}
            await hs.send(encode_handshake_message(READY, local=False, headless=True, **extra))
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
            while self.options.frozen:  # a stopped process: nothing runs until it thaws
                await asyncio.sleep(FROZEN_CHECK_S)
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
        if self.on_request is not None:
            scripted = self.on_request(client_index, call_id, method, args)
            if scripted is not None:
                await self._reply(
                    client_index, call_id, value=scripted.value, failure=scripted.failure
                )
                return
        try:
            result = self.state.call(method, args, now=self.clock())
        except UtilityFailure as exc:
            await self._reply(client_index, call_id, failure=str(exc))
            return
        if isinstance(result, Deferred):
            # Deferred reply: other utilities are answered meanwhile (replies out of order).
            self._defer(result, client_index, call_id)
            return
        await self._reply(client_index, call_id, value=result)

    def _defer(self, deferred: Deferred, client_index: int, call_id: int) -> None:
        def fire() -> None:
            self._deferred.discard(handle)
            task = asyncio.create_task(self._reply(client_index, call_id, value=deferred.value))
            self._replies.add(task)
            task.add_done_callback(self._replies.discard)

        handle = asyncio.get_running_loop().call_later(deferred.delay_s, fire)
        self._deferred.add(handle)

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
            self.engine_index,
            call_id,
            value=value,
            failure_message=failure,
            timestamp=self.clock(),
            engine_notifications=self.options.engine_notifications,
        )
        await self._send(client_index, frame)
        self.replies += 1

    async def _send(self, client_index: int, frame: bytes) -> None:
        await self._outputs[client_index].send(frame)
        if self.on_output is not None:
            self.on_output(client_index, frame)

    async def _die(self, why: str) -> None:
        log.error("engine %d died: %s", self.engine_index, why)
        for sock in self._outputs:
            await sock.send(ENGINE_CORE_DEAD)
        self._exit_reason = "dead"
        self._stop.set()


def _connect(sock: zmq.asyncio.Socket, address: str) -> None:
    """Connect as vLLM's ``make_zmq_socket`` does: ``zmq.IPV6`` on for an IPv6 TCP host."""
    if _is_ipv6_tcp(address):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(address)


def _is_ipv6_tcp(address: str) -> bool:
    """``tcp://[::1]:5555`` and the like (vLLM: ``split_zmq_path`` + ``is_valid_ipv6_address``)."""
    try:
        parts = urlsplit(address)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme != "tcp" or not host:
        return False
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False
