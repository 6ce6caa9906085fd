"""``has_work``'s request in HTTP mode: vLLM has no route for it, so ``GET /metrics``, read up to
its own documented limit (pure; the other routes: tests/integration/http/test_http_rl_client.py)."""

from __future__ import annotations

import pytest

from exporter.client.fleet import READ_METHODS
from exporter.client.http.routes import MAX_ANSWER, MAX_METRICS_ANSWER, Route, route
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


def test_every_read_method_has_a_route() -> None:
    assert all(route(method).verb == "GET" for method in READ_METHODS)
