"""Each API server's elastic-EP operation in the snapshot, the ``vllm_dp_elastic_ep_*`` series,
the ``/status`` document, the status page and the Python client's ``Status``, over the
in-memory ``FakeFleet`` (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.base.steps import run_steps
from exporter.client.fake import FakeFleet, answers
from exporter.client.fleet import ELASTIC_EP_PHASES, ElasticEpOperation, ElasticEpRead
from exporter.remote.errorbase import InvalidAnswer
from exporter.remote.status import Status
from exporter.web.statusdoc import status_steps
from exporter.web.statuspage import elastic_ep_line, elastic_ep_shown, page_steps
from tests.harness.scrape import metric_value
from tests.harness.statusschema import validate_status
from tests.unit.control.test_fleet_semantics import make_exporter, scrape

PHASES = ELASTIC_EP_PHASES
HOSTILE = '<script>alert("x")</script>&<img src=x onerror=alert(1)>'
AWAKE = {"is_sleeping": False, "is_scheduler_paused": False, "get_weight_version": "v1"}


def fleet(reads: tuple[ElasticEpRead, ...] | None) -> FakeFleet:
    return FakeFleet(answers({"0": AWAKE, "1": AWAKE}), elastic_ep=reads)


READS = (
    ElasticEpRead("a", ElasticEpOperation("idle"), read_at_unix=100.0),
    ElasticEpRead(
        "b",
        ElasticEpOperation("committing", epoch="12", requested_data_parallel_size=4, scaling=True),
        read_at_unix=101.0,
    ),
    ElasticEpRead("c", ElasticEpOperation("failed", epoch="9c2e", error="rank 3 left")),
    ElasticEpRead("d", problem="unsupported here: HTTP 501", supported=False),
    ElasticEpRead("e", problem="HTTP 503 from POST /is_scaling_elastic_ep"),
    ElasticEpRead("f", ElasticEpOperation("other", reported_phase="draining")),
)


async def test_each_server_s_operation_is_a_state_set_and_a_status_entry() -> None:
    exporter = make_exporter(fleet(READS))
    await exporter.poller.poll_once()
    m = scrape(exporter)
    series = {
        t: {p: metric_value(m, "vllm_dp_elastic_ep_operation", target=t, phase=p) for p in PHASES}
        for t in "abcdef"
    }
    for target, phase in {"a": "idle", "b": "committing", "c": "failed", "f": "other"}.items():
        assert series[target] == {p: 1.0 if p == phase else 0.0 for p in PHASES}
    # Not known: no series at all, never a stale or a zero phase.
    assert series["d"] == series["e"] == dict.fromkeys(PHASES)
    assert metric_value(m, "vllm_dp_elastic_ep_epoch", target="b") == 12.0
    assert metric_value(m, "vllm_dp_elastic_ep_epoch", target="c") is None  # not a number
    assert metric_value(m, "vllm_dp_elastic_ep_requested_data_parallel_size", target="b") == 4.0
    assert metric_value(m, "vllm_dp_elastic_ep_requested_data_parallel_size", target="a") is None

    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    entries = {e["target"]: e for e in doc["elastic_ep_operations"]}
    assert list(entries) == list("abcdef")
    assert entries["b"] == {
        "target": "b",
        "phase": "committing",
        "reported_phase": None,
        "scaling": True,
        "epoch": "12",
        "error": None,
        "requested_data_parallel_size": 4,
        "supported": True,
        "read_at_unix": 101.0,
        "problem": None,
    }
    assert (entries["d"]["supported"], entries["d"]["phase"]) == (False, None)
    assert entries["f"]["reported_phase"] == "draining"

    status = Status.from_json(doc)
    assert status.elastic_ep_operations is not None
    assert [o.target for o in status.elastic_ep_operations if o.failed] == ["c"]
    assert status.elastic_ep_operations[1].requested_data_parallel_size == 4

    page = run_steps(page_steps(doc))
    assert 'id="elastic-section">' in page
    assert '<li class="ee-failed" data-target="c"><strong>c</strong>: failed, epoch 9c2e, ' in page
    assert "committing, serving paused, to DP size 4, epoch 12" in page
    assert "other (draining)" in page


async def test_a_mode_without_api_servers_says_null_and_publishes_nothing() -> None:
    exporter = make_exporter(fleet(None))
    await exporter.poller.poll_once()
    assert not [name for name in scrape(exporter) if "elastic_ep" in name]
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    validate_status(doc)
    assert doc["elastic_ep_operations"] is None
    assert Status.from_json(doc).elastic_ep_operations is None
    assert 'id="elastic-section" hidden' in run_steps(page_steps(doc))


@pytest.mark.parametrize(
    ("ops", "shown"),
    [
        (None, False),
        ([], False),
        ([{"phase": "idle"}, {"phase": None, "supported": False, "problem": "unsupported"}], False),
        ([{"phase": None, "supported": True, "problem": None}], False),  # not read yet
        ([{"phase": "idle"}, {"phase": "completed"}], True),
        ([{"phase": "failed"}], True),
        ([{"phase": None, "supported": True, "problem": "HTTP 503"}], True),
    ],
)
def test_the_page_shows_the_servers_unless_all_are_idle(
    ops: list[dict[str, Any]] | None, shown: bool
) -> None:
    assert elastic_ep_shown(ops) is shown


def test_lines_read_like_the_script_s() -> None:
    assert elastic_ep_line({"phase": None, "problem": None}) == ("not read yet", "unknown")
    assert elastic_ep_line({"phase": "preparing", "scaling": True, "epoch": "3"}) == (
        "preparing, serving paused, epoch 3",
        "preparing",
    )


async def test_every_string_is_escaped() -> None:
    hostile = (ElasticEpRead(HOSTILE, ElasticEpOperation("failed", epoch=HOSTILE, error=HOSTILE)),)
    exporter = make_exporter(fleet(hostile))
    await exporter.poller.poll_once()
    doc = run_steps(status_steps(exporter.poller.snapshot, exporter.config, exporter.stats))
    page = run_steps(page_steps(doc))
    assert page.count("<script") == 1 and "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page


def test_the_client_refuses_an_entry_of_the_wrong_type() -> None:
    doc = {"elastic_ep_operations": [{"target": "a", "phase": 3}]}
    with pytest.raises(InvalidAnswer, match=r"elastic_ep_operations\[0\]\.phase"):
        Status.from_json(doc)
    with pytest.raises(InvalidAnswer, match="target"):
        Status.from_json({"elastic_ep_operations": [{"phase": "idle"}]})
