"""The simulated API server's HTTP envelope on its own: JSON as Starlette writes it, FastAPI's
query and body validation with vLLM's 400 envelope, and vLLM's ``/metrics`` text."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from exporter.sim.api_wire import (
    _BadQuery,
    _EngineError,
    _json,
    _json_body,
    _query_bool,
    _query_mode,
    _RustFrontEndError,
    _validation_error,
    metrics_text,
)


def with_body(body: bytes) -> web.Request:
    """A POST whose body is ``body`` (a fed stream: nothing is received)."""
    payload = StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop())
    payload.feed_data(body)
    payload.feed_eof()
    return make_mocked_request("POST", "/x", payload=payload)


def test_json_is_compact_utf8_with_starlettes_content_type() -> None:
    resp = _json({"a": [1, 2], "é": None}, status=409, headers={"x-h": "1"})
    assert resp.body == '{"a":[1,2],"é":null}'.encode()
    assert (resp.status, resp.content_type, resp.headers["x-h"]) == (409, "application/json", "1")
    with pytest.raises(ValueError):
        _json({"bad": float("nan")})  # Starlette refuses NaN too


@pytest.mark.parametrize(
    ("raw", "value"),
    [("1", True), ("ON", True), (" yes ", True), ("t", True), ("0", False), ("No", False)],
)
def test_booleans_as_pydantic_reads_them(raw: str, value: bool) -> None:
    request = make_mocked_request("POST", f"/x?flag={raw}")
    assert _query_bool(request, "flag") is value


def test_a_missing_boolean_is_its_default_and_a_bad_one_is_refused() -> None:
    assert _query_bool(make_mocked_request("POST", "/x"), "flag", default=True) is True
    with pytest.raises(_BadQuery) as refused:
        _query_bool(make_mocked_request("POST", "/x?flag=maybe"), "flag")
    assert (refused.value.name, refused.value.raw, refused.value.kind) == (
        "flag",
        "maybe",
        "bool_parsing",
    )


def test_the_pause_mode_defaults_to_abort_and_is_a_literal() -> None:
    assert _query_mode(make_mocked_request("POST", "/pause")) == "abort"
    assert _query_mode(make_mocked_request("POST", "/pause?mode=keep")) == "keep"
    with pytest.raises(_BadQuery) as refused:
        _query_mode(make_mocked_request("POST", "/pause?mode=drain"))
    assert refused.value.kind == "literal_error" and refused.value.where == "query"


async def test_a_json_body_is_an_object_or_a_400() -> None:
    assert await _json_body(with_body(b"")) == {}
    assert await _json_body(with_body(b'{"action": "reset"}')) == {"action": "reset"}
    with pytest.raises(_BadQuery) as invalid:
        await _json_body(with_body(b"{not json"))
    assert (invalid.value.kind, invalid.value.where) == ("json_invalid", "body")
    with pytest.raises(_BadQuery) as listed:
        await _json_body(with_body(b"[1]"))
    assert (listed.value.kind, listed.value.raw) == ("model_attributes_type", [1])


def test_the_validation_envelope_names_the_field() -> None:
    error = _BadQuery("mode", "drain", "literal_error", "Input should be 'abort'")
    envelope = _validation_error(error)["error"]
    assert (envelope["type"], envelope["param"], envelope["code"]) == (
        "Bad Request",
        "query.mode",
        400,
    )
    assert envelope["message"].startswith("1 validation error:\n  {'type': 'literal_error'")
    assert "'loc': ('query', 'mode')" in envelope["message"]
    body = _validation_error(_BadQuery(0, {}, "json_invalid", "JSON decode error", where="body"))
    assert body["error"]["param"] == "body.0"


def test_a_rust_front_end_failure_is_an_engine_failure() -> None:
    """Routes that catch engine failures catch the Rust front end's too, unless they say so."""
    assert issubclass(_RustFrontEndError, _EngineError)


def test_metrics_text_is_prometheus_text_with_one_series_per_engine() -> None:
    text = metrics_text({4: (1, 2), 5: (0, 7)})
    samples = {
        (s.name, s.labels.get("engine")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:num_requests")
    }
    assert samples == {
        ("vllm:num_requests_running", "4"): 1.0,
        ("vllm:num_requests_running", "5"): 0.0,
        ("vllm:num_requests_waiting", "4"): 2.0,
        ("vllm:num_requests_waiting", "5"): 7.0,
    }
    assert 'vllm:num_requests_waiting{engine="5",model_name="sim"} 7.0\n' in text


def test_metrics_text_without_log_stats_has_only_the_servers_own_metrics() -> None:
    text = metrics_text({0: (3, 3)}, log_stats=False)
    names = {family.name for family in text_string_to_metric_families(text)}
    assert names == {"python_gc_objects_collected"}
    assert "vllm:" not in text
    assert "engine=" not in metrics_text({}), "no engines: the families, no samples"
