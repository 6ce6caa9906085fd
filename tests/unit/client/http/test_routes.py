"""``has_work``'s request in HTTP mode: vLLM has no route for it, so ``GET /metrics``, read up to
its own documented limit (pure; the other routes: tests/integration/http/test_http_rl_client.py)."""

from __future__ import annotations

import pytest

from exporter.client.fleet import READ_METHODS
from exporter.client.http.routes import (
    MAX_ANSWER,
    MAX_METRICS_ANSWER,
    ROUTED_METHODS,
    Route,
    route,
)
from exporter.error import MethodNotAllowed


def test_has_work_is_a_get_of_metrics_read_up_to_its_own_limit() -> None:
    spec = route("has_work")
    assert spec == Route("GET", "/metrics")
    assert (spec.query, spec.body, spec.limit) == (None, None, MAX_METRICS_ANSWER)
    assert MAX_ANSWER < MAX_METRICS_ANSWER == 16 << 20


@pytest.mark.parametrize("args", [(1,), (True,), ("engine",)])
def test_has_work_takes_no_arguments(args: tuple[object, ...]) -> None:
    with pytest.raises(MethodNotAllowed, match="has_work"):
        route("has_work", args)


def test_every_polled_read_has_a_route_and_inference_readiness_has_none() -> None:
    polled = READ_METHODS - {"is_inference_ready"}
    assert all(route(method).verb == "GET" for method in polled)
    assert polled <= ROUTED_METHODS and "is_inference_ready" not in ROUTED_METHODS
    with pytest.raises(MethodNotAllowed, match="no HTTP route"):
        route("is_inference_ready")
