"""The simulated API server's elastic-EP route, ``POST /is_scaling_elastic_ep``, as each vLLM
release answers it (``exporter.sim.api_server``; served whatever the dev mode, as vLLM serves it
wherever it serves ``generate``).

vLLM 0.33 (``vllm_version`` 0.33 or later, the default): ``{"is_scaling_elastic_ep": bool,
"phase", "epoch", "error", "requested_data_parallel_size"}``, ``is_scaling_elastic_ep`` true in
``preparing`` and ``committing`` (its ``ExternalElasticEPCoordinator.get_status``); 503 in
vLLM's error envelope ("External Elastic EP status is temporarily unavailable") while its shared
store cannot be read (``SimElasticEp.unavailable``). vLLM 0.32: ``{"is_scaling_elastic_ep":
bool}`` alone (its process-local flag: true in ``preparing`` and ``committing``). vLLM's Rust
front end (``rust_front_end``): 404 (the 0.32 binary, no such route) or 501 (the 0.33 binary).
``SimElasticEp.answer`` is served instead of all of it (a hostile body), after
``SimElasticEp.delay_s`` when set (a route that hangs).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.sim.api_wire import _HttpError, _json

ELASTIC_EP_PATH = "/is_scaling_elastic_ep"
IDLE = "idle"
#: The phases in which vLLM's route answers ``is_scaling_elastic_ep`` true.
SCALING = frozenset({"preparing", "committing"})
UNAVAILABLE = "External Elastic EP status is temporarily unavailable"
RUST_NOT_IMPLEMENTED = "POST /is_scaling_elastic_ep is not implemented by the Rust front end"


@dataclass
class SimElasticEp:
    """One simulated server's elastic-EP operation (as its shared store holds it) and faults."""

    phase: str = IDLE
    epoch: str | None = None
    error: str | None = None
    requested: int | None = None
    #: Fault: vLLM cannot read its shared store (503).
    unavailable: bool = False
    #: Fault: this body (200, ``application/json``) instead of the answer.
    answer: bytes | None = None
    #: Fault: seconds before any answer (a store read that hangs).
    delay_s: float = 0.0

    def status(self) -> dict[str, Any]:
        """vLLM 0.33's ``get_status()`` map."""
        return {
            "phase": self.phase,
            "epoch": self.epoch,
            "error": self.error,
            "requested_data_parallel_size": self.requested,
        }


def release(version: str) -> tuple[int, ...]:
    """``"0.33.0rc1"`` → ``(0, 33, 0)``: the leading numbers of a version string."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


async def elastic_ep_answer(
    state: SimElasticEp, vllm_version: str, rust_front_end: str | None
) -> web.Response:
    """The route's answer on this server (``_HttpError``: vLLM's error envelope)."""
    if state.delay_s > 0:
        await asyncio.sleep(state.delay_s)
    if rust_front_end is not None:
        if release(rust_front_end) < (0, 33):
            return _json({"detail": "Not Found"}, status=404)
        return _json({"error": {"message": RUST_NOT_IMPLEMENTED, "code": 501}}, status=501)
    if state.answer is not None:
        return web.Response(body=state.answer, content_type="application/json")
    scaling = state.phase in SCALING
    if release(vllm_version) < (0, 33):
        return _json({"is_scaling_elastic_ep": scaling})
    if state.unavailable:
        raise _HttpError(503, UNAVAILABLE)
    return _json({"is_scaling_elastic_ep": scaling, **state.status()})
