"""``GET /kv_events_targets``: every engine's KV-events publisher as a Prometheus HTTP
service-discovery document (``http_sd``), so a KV-index consumer finds every DP rank's
publisher without configuration (pure).

The format is Prometheus' ``http_sd_config`` answer: a JSON list of target groups, here one per
publishing engine, ``{"targets": ["host:port"], "labels": {...}}``; an empty list when no engine
publishes. Labels: ``engine`` (the DP rank, as in every series), ``topic`` (the ZMQ topic to
subscribe to; ``""`` subscribes to everything), ``endpoint`` (as the engine registered it),
``publisher``, ``replay`` (``host:port`` of the replay ROUTER, only when the engine has one) and
``model_name`` with ``--model-name``. Only connected engines with a target a consumer can
connect to are listed; ``/status`` shows every engine's publisher, and why one has no target.
"""

from __future__ import annotations

from typing import Any

from exporter.fleetstate.snapshot import FleetSnapshot


def kv_events_targets(snap: FleetSnapshot, model_name: str | None = None) -> list[dict[str, Any]]:
    """One target group per connected engine whose publisher has a TCP target, engine order."""
    groups: list[dict[str, Any]] = []
    for e in snap.engines:
        source = e.detail.kv_events
        if source is None or source.target is None or not e.detail.connected:
            continue
        labels = {
            "engine": e.engine,
            "topic": source.topic,
            "endpoint": source.endpoint,
            "publisher": source.publisher,
        }
        if source.replay_target is not None:
            labels["replay"] = source.replay_target
        if model_name:
            labels["model_name"] = model_name
        groups.append({"targets": [source.target], "labels": labels})
    return groups
