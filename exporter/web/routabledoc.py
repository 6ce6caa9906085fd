"""``GET /routable`` and ``GET /readyz?engine=N`` (docs/activity.md), and each engine's
``routable`` entry of ``/status``: the verdict of ``fleetstate.activity.routability`` over the
last poll's snapshot, as JSON (pure, no call to any engine)."""

from __future__ import annotations

from typing import Any

from exporter.fleetstate.activity import routability
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot


def routable_json(e: EngineSnapshot) -> dict[str, Any]:
    """Whether a router should send ``e`` traffic, and why not (``fleetstate.activity``)."""
    verdict = routability(e)
    return {"routable": verdict.routable, "reasons": list(verdict.reasons)}


def routable_document(snap: FleetSnapshot) -> dict[str, Any]:
    """``GET /routable``: every expected rank's verdict from the last poll (cheap: no call)."""
    engines = [{"engine": e.engine, **routable_json(e)} for e in snap.engines]
    return {
        "poll": snap.poll_number,
        "taken_at_unix": snap.taken_at_unix or None,
        "routable_engines": [e["engine"] for e in engines if e["routable"]],
        "engines": engines,
    }


def engine_readiness(snap: FleetSnapshot, engine: str) -> tuple[int, dict[str, Any]]:
    """``GET /readyz?engine=N``: 200 while rank ``engine`` is routable, 503 with the reasons,
    404 for an engine this exporter does not know."""
    found = next((e for e in snap.engines if e.engine == engine), None)
    if found is None:
        known = [e.engine for e in snap.engines]
        return 404, {"error": f"no engine {engine[:64]!r} (known: {', '.join(known)})"}
    body = {"engine": engine, "poll": snap.poll_number, **routable_json(found)}
    return (200 if body["routable"] else 503), body
