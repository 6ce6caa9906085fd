"""vLLM 0.34's checkpoint routes on the simulated API server (``exporter.sim.api_server``),
answered as 0.34's ``vllm/entrypoints/serve/checkpoint/api_router.py`` answers them, over the
server's engines: each engine keeps its own state (``EngineState.checkpoint``,
``exporter.sim.checkpoint``), reached through the server's utility fan-out, so its faults
(a hang, a failure, a dead engine) apply here as on every route.

vLLM mounts them beside ``generate``, whatever the dev mode, from 0.34 on and only with
``--enable-sleep-mode`` (``entrypoints/launchers/api_server/routers.py``): a 404 elsewhere.
Every answer is ``{"state": .., "error": ..}`` (``error`` left out when None):

- ``GET /checkpoint/status``: 200 while ``prepared``, 500 once ``failed``, 503 otherwise.
- ``POST /checkpoint/prepare?mode=`` (vLLM's default ``wait``): from ``running`` it prepares,
  400 with the engine's refusal as ``error``; 400 from ``restoring`` or ``failed``; else 200.
- ``POST /checkpoint/restore``: 400 from ``preparing`` or ``failed``; from ``prepared`` it
  restores; 200 with the state read afterwards (a restore repeated is a 200).

A server with several engines answers vLLM's own aggregate, which is not strict
(``DPLBAsyncMPClient.checkpoint_state_async``): failed if any failed (the first failed
engine's error), the common state if all agree, else ``preparing`` or ``restoring``; a
prepare runs on every engine and answers the first engine's refusal. An engine's failure is
vLLM's 500. ``CheckpointRoutes.answers`` serves a test's hostile answer instead.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from exporter.sim.api_wire import _json, _query_mode
from exporter.sim.checkpoint import (
    FAILED,
    PREPARED,
    PREPARING,
    RESTORING,
    RUNNING,
    has_lifecycle,
)

STATUS_PATH, PREPARE_PATH, RESTORE_PATH = (
    "/checkpoint/status",
    "/checkpoint/prepare",
    "/checkpoint/restore",
)
#: ``call_all(method, *args)``: the method on every engine of the server, in engine order.
CallAll = Callable[..., Awaitable[list[Any]]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def mounted(vllm_version: str, rust_front_end: str | None, sleep_mode: bool) -> bool:
    """Whether the server serves the routes: a 0.34 front end (the Rust one's own release
    when it answers instead), started with ``--enable-sleep-mode``."""
    return sleep_mode and has_lifecycle(rust_front_end or vllm_version)


def aggregate(answers: Sequence[Sequence[str | None]]) -> tuple[str, str | None]:
    """vLLM's ``checkpoint_state`` over several engines (not strict: which one is behind is
    lost, which is why the exporter reads every rank on its own)."""
    states: dict[str, str | None] = {}
    for state, error in answers:
        assert state is not None  # the simulated engines answer one of the five
        states.setdefault(state, error)
    if FAILED in states:
        return FAILED, states[FAILED]
    if len(states) == 1:
        return next(iter(states)), None
    return (PREPARING if PREPARING in states else RESTORING), None


def state_answer(state: str, error: str | None, status: int) -> web.Response:
    """``CheckpointStateResponse`` dumped with ``exclude_none``."""
    return _json({"state": state} if error is None else {"state": state, "error": error}, status)


@dataclass
class CheckpointRoutes:
    """The three handlers of one server, over its utility fan-out (``call_all``)."""

    call_all: CallAll
    #: Path → (status, body) served instead of the route's answer (a hostile server).
    answers: dict[str, tuple[int, bytes]] = field(default_factory=dict)

    def routes(self) -> list[tuple[str, str, Handler]]:
        """(method, path, handler) of each route."""
        return [
            ("GET", STATUS_PATH, self.status),
            ("POST", PREPARE_PATH, self.prepare),
            ("POST", RESTORE_PATH, self.restore),
        ]

    async def _state(self) -> tuple[str, str | None]:
        return aggregate(await self.call_all("checkpoint_state"))

    def _hostile(self, request: web.Request) -> web.Response | None:
        given = self.answers.get(request.path)
        if given is None:
            return None
        status, body = given
        return web.Response(body=body, status=status, content_type="application/json")

    async def status(self, request: web.Request) -> web.Response:
        """Polled by orchestrators: 200 once safe to capture, 503 until then, 500 failed."""
        hostile = self._hostile(request)
        if hostile is not None:
            return hostile
        state, error = await self._state()
        code = {PREPARED: 200, FAILED: 500}.get(state, 503)
        return state_answer(state, error, code)

    async def prepare(self, request: web.Request) -> web.Response:
        """Start a prepare on every engine (answers once started; a repeat is a no-op)."""
        hostile = self._hostile(request)
        if hostile is not None:
            return hostile
        mode = _query_mode(request, default="wait")
        state, error = await self._state()
        if state == RUNNING:
            refusal = (await self.call_all("checkpoint_prepare", mode))[0]
            if refusal:
                return state_answer(state, str(refusal), 400)
            state, error = await self._state()
        elif state in (RESTORING, FAILED):
            return state_answer(state, error, 400)
        return state_answer(state, error, 200)

    async def restore(self, request: web.Request) -> web.Response:
        """Restore every engine; orchestrators may redeliver, so a restore done is a 200."""
        hostile = self._hostile(request)
        if hostile is not None:
            return hostile
        state, error = await self._state()
        if state in (PREPARING, FAILED):
            return state_answer(state, error, 400)
        if state == PREPARED:
            await self.call_all("checkpoint_restore")
            state, error = await self._state()
        return state_answer(state, error, 200)
