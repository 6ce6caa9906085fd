"""The read answers, framework-free, and the one table of them both servers register.

``/status``, the status page, ``/gate``, ``/readyz``, ``/routable`` and ``/kv_events_targets``
answer the same wherever they are asked: the aiohttp service registers ``READ_ROUTES`` at its
root, the plugin under ``/dp`` on vLLM's port. Each answer is built from the exporter's state by
the builders of ``exporter.web`` and comes back as an ``RouteAnswer`` (status, bytes, headers); the
two adapters only turn a request's query into a ``Query`` and an ``RouteAnswer`` into their
framework's response. ``run`` runs a builder's steps: at once in the service, a step per turn
of vLLM's event loop in the plugin (``exporter.base.steps``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from exporter.base.steps import Steps, run_steps
from exporter.client.observe import unexpected_engines
from exporter.control.gate import GateRequestError, parse_conditions
from exporter.control.runtime import Exporter
from exporter.web.kvtargets import kv_events_targets
from exporter.web.routabledoc import engine_readiness, routable_document
from exporter.web.statusdoc import json_steps, status_steps
from exporter.web.statuspage import HEADERS as PAGE_HEADERS
from exporter.web.statuspage import page_steps

#: A request's query: every value of every parameter, in order.
Query = Mapping[str, list[str]]
#: Runs a builder's steps to its result: at once, or a step per loop turn.
StepRunner = Callable[[Steps[Any]], Awaitable[Any]]

JSON = "application/json; charset=utf-8"
HTML = "text/html; charset=utf-8"
NO_STORE = {"Cache-Control": "no-store"}
#: ``/routable`` is computed from the last poll: a router polling it every second may cache.
ROUTABLE_CACHE = "max-age=1"


@dataclass(frozen=True)
class RouteAnswer:
    """What a route answers, whichever server was asked."""

    status: int
    body: bytes
    content_type: str = JSON
    headers: Mapping[str, str] = field(default_factory=dict)


def json_answer(
    body: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> RouteAnswer:
    """``body`` as ``json.dumps`` writes it (what aiohttp's ``json_response`` wrote)."""
    return RouteAnswer(status, json.dumps(body).encode(), JSON, headers or {})


def not_started(problem: str | None) -> RouteAnswer:
    """Every read route's answer while there is no exporter to ask (the plugin before vLLM
    initialised it, or after a failed start: ``problem`` says which)."""
    return json_answer({"ok": False, "error": problem}, status=503)


async def at_once(steps: Steps[Any]) -> Any:
    """The service's ``StepRunner``: every step in one go."""
    return run_steps(steps)


def status_document_steps(exporter: Exporter) -> Steps[dict[str, Any]]:
    """The ``/status`` document (and the page's data) of ``exporter`` now, in steps."""
    poller = exporter.poller
    return status_steps(
        poller.snapshot,
        exporter.config,
        exporter.stats,
        poller.history,
        unexpected=unexpected_engines(exporter.client.observations),
        feeds=exporter.feeds_json(),
        source=poller.source.describe(),
    )


async def gate_answer(exporter: Exporter, query: Query) -> tuple[int, Any]:
    """The gate's status and JSON body for ``query`` (400 for a bad one)."""
    try:
        conditions = parse_conditions(query)
    except GateRequestError as exc:
        return 400, {"ok": False, "error": str(exc)}
    return await exporter.gate.check(conditions)


def readiness(exporter: Exporter, engines: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    """``/readyz``: 200 when every expected engine answered the last poll, else 503;
    ``/readyz?engine=N``: 200 while rank N is routable (``routabledoc.engine_readiness``)."""
    snap = exporter.poller.snapshot
    if engines:
        if len(engines) > 1:
            return 400, {"error": "engine given more than once"}
        return engine_readiness(snap, engines[0])
    body = {
        "ready": snap.ready,
        "engines_expected": snap.expected,
        "engines_connected": snap.connected,
        "last_poll": snap.poll_number,
    }
    return (200 if snap.ready else 503), body


async def status(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    """The fleet as JSON (``exporter.web.statusdoc``; schema: docs/status.schema.json)."""
    doc = await run(status_document_steps(exporter))
    return RouteAnswer(200, await run(json_steps(doc)), JSON, NO_STORE)


async def page(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    """The incident view (``exporter.web.statuspage``), from the same document as /status."""
    doc = await run(status_document_steps(exporter))
    html: str = await run(page_steps(doc))
    return RouteAnswer(200, html.encode(), HTML, PAGE_HEADERS)


async def gate(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    """The safe-to-resume gate (``exporter.control.gate``): JSON in every case."""
    code, body = await gate_answer(exporter, query)
    return json_answer(body, code, NO_STORE)


async def readyz(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    code, body = readiness(exporter, list(query.get("engine", [])))
    return json_answer(body, code)


async def routable(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    """Every rank's routable verdict from the last poll (``routabledoc.routable_document``)."""
    doc = routable_document(exporter.poller.snapshot)
    return json_answer(doc, headers={"Cache-Control": ROUTABLE_CACHE})


async def kv_events(exporter: Exporter, query: Query, run: StepRunner) -> RouteAnswer:
    """Every engine's KV-events publisher, an ``http_sd`` document (``exporter.web.kvtargets``)."""
    doc = kv_events_targets(exporter.poller.snapshot, exporter.config.model_name)
    return json_answer(doc, headers=NO_STORE)


AnswerFn = Callable[[Exporter, Query, StepRunner], Awaitable[RouteAnswer]]


@dataclass(frozen=True)
class ReadRoute:
    """One read route: its path below the server's prefix, its answer, and its summary (the
    plugin's entry in vLLM's OpenAPI schema)."""

    path: str
    answer: AnswerFn
    summary: str
    #: The name of the handler a server registers (the plugin's OpenAPI operation).
    name: str


#: Every read route, in the order the servers register them.
READ_ROUTES = (
    ReadRoute(
        "/status", status, "Every DP engine's state (the exporter's /status document)", "status"
    ),
    ReadRoute("/", page, "The status page", "page"),
    ReadRoute("/gate", gate, "The safe-to-resume gate", "gate"),
    ReadRoute(
        "/readyz",
        readyz,
        "Whether every engine answered the last poll (?engine=N: whether rank N is routable)",
        "readyz",
    ),
    ReadRoute("/routable", routable, "Which ranks should take traffic, and why not", "routable"),
    ReadRoute(
        "/kv_events_targets",
        kv_events,
        "Every DP engine's KV-events publisher (Prometheus http_sd)",
        "kv_events",
    ),
)
