"""The HTTP envelope of the simulated vLLM API server: JSON answers as Starlette writes them,
query and body validation with vLLM's 400 envelope, and the errors its routes raise."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from exporter.protocol.utility import PAUSE_MODES

#: pydantic's boolean strings (what FastAPI accepts for ``bool`` query parameters).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """Starlette's JSONResponse: compact separators, ``content-type: application/json``."""
    body = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(
        body=body.encode(), status=status, headers=headers, content_type="application/json"
    )


class _BadQuery(Exception):
    """A FastAPI validation error of one query (``where="query"``) or body field."""

    def __init__(
        self, name: str | int, raw: Any, kind: str, msg: str, where: str = "query"
    ) -> None:
        super().__init__(msg)
        self.name, self.raw, self.kind, self.msg, self.where = name, raw, kind, msg, where


class _EngineError(Exception):
    """One engine's utility call raised (vLLM: "Call to <method> method failed: <text>")."""


class _RustFrontEndError(_EngineError):
    """vLLM's Rust front end failed a call (its 500 envelope, ``type`` by release)."""


class _HttpError(Exception):
    """A FastAPI ``HTTPException`` raised by a route (vLLM's error envelope, connection kept)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


#: FastAPI's HTTPStatus phrases for the statuses the routes raise.
_PHRASES = {
    400: "Bad Request",
    409: "Conflict",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
WEIGHT_CHECKER_ACTIONS = ("checksum", "reset", "compare")


async def _json_body(request: web.Request) -> dict[str, Any]:
    """The JSON object body FastAPI's ``Body(embed=True)`` parameters read (else a 400)."""
    raw = await request.read()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise _BadQuery(0, {}, "json_invalid", "JSON decode error", where="body") from None
    if not isinstance(data, dict):
        raise _BadQuery(
            0, data, "model_attributes_type", "Input should be a valid dictionary", where="body"
        )
    return data


def _query_mode(request: web.Request, default: str = "abort") -> str:
    """``mode`` as vLLM's ``PauseMode`` query parameter (its default differs by route)."""
    mode = request.query.get("mode", default)
    if mode not in PAUSE_MODES:
        raise _BadQuery("mode", mode, "literal_error", "Input should be 'abort', 'wait' or 'keep'")
    return mode


def _query_bool(request: web.Request, name: str, default: bool = False) -> bool:
    raw = request.query.get(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise _BadQuery(
        name, raw, "bool_parsing", "Input should be a valid boolean, unable to interpret input"
    )


#: What the simulated ``/metrics`` says besides the request counts (a process metric and a
#: vLLM family of every engine, as vLLM's exposition has many), so a reader must pick its lines.
_METRICS_PROLOGUE = (
    "# HELP python_gc_objects_collected_total Objects collected during gc\n"
    "# TYPE python_gc_objects_collected_total counter\n"
    'python_gc_objects_collected_total{generation="0"} 1234.0\n'
)


#: prometheus_client's ``CONTENT_TYPE_LATEST`` (the classic text format vLLM's ``/metrics`` sends).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def metrics_text(
    counts: dict[int, tuple[int, int]],
    log_stats: bool = True,
    tokens: dict[int, int] | None = None,
) -> str:
    """vLLM's ``/metrics`` (Prometheus text, as ``prometheus_client`` writes it) for engines
    rank → (running, waiting): ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
    per ``engine`` label, floats as prometheus_client prints them, and (``tokens``: rank →
    generated tokens) ``vllm:prompt_tokens_total`` (0 here) and
    ``vllm:generation_tokens_total``; without ``log_stats`` (``--disable-log-stats``) none of
    these, only the server's other metrics."""
    lines = [_METRICS_PROLOGUE]
    if log_stats:
        families = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", 0),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", 1),
        )
        for name, help_text, index in families:
            lines.append(f"# HELP {name} {help_text}\n# TYPE {name} gauge\n")
            for rank, pair in counts.items():
                labels = f'engine="{rank}",model_name="sim"'
                lines.append(f"{name}{{{labels}}} {float(pair[index])!r}\n")
        lines.append("# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n")
        lines.append("# TYPE vllm:kv_cache_usage_perc gauge\n")
        for rank in counts:
            lines.append(f'vllm:kv_cache_usage_perc{{engine="{rank}",model_name="sim"}} 0.0\n')
        if tokens is not None:
            lines.append(_token_counters(tokens))
    return "".join(lines)


def _token_counters(tokens: dict[int, int]) -> str:
    """vLLM's per-engine token counters: prompt tokens (0: the simulated requests have none
    counted) and generated tokens."""
    lines = []
    for name, what in (("prompt", "prefill"), ("generation", "generation")):
        family = f"vllm:{name}_tokens"
        lines.append(f"# HELP {family}_total Number of {what} tokens processed.\n")
        lines.append(f"# TYPE {family}_total counter\n")
        for rank, count in tokens.items():
            value = float(count) if name == "generation" else 0.0
            lines.append(f'{family}_total{{engine="{rank}",model_name="sim"}} {value!r}\n')
    return "".join(lines)


def _validation_error(exc: _BadQuery) -> dict[str, Any]:
    """vLLM's RequestValidationError envelope (str() of FastAPI's error list as the message)."""
    detail = {"type": exc.kind, "loc": (exc.where, exc.name), "msg": exc.msg, "input": exc.raw}
    return {
        "error": {
            "message": f"1 validation error:\n  {detail!r}\n",
            "type": "Bad Request",
            "param": f"{exc.where}.{exc.name}",
            "code": 400,
        }
    }
