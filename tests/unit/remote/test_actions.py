"""The named actions of ``Client`` (``exporter.remote.actions``), vLLM 0.34's checkpoint pair
and the gate's ``checkpoint`` condition: which request each makes and which result or typed
error each answer becomes (the scripted ``Http`` of ``test_client``: no socket)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.remote import client as client_module
from exporter.remote.actions import ACTION_TIMEOUT_S, RESET_TIMEOUT_S, VERIFY_TIMEOUT_S
from exporter.remote.errors import BadRequest, PartialFailure, Unsupported
from exporter.remote.http import NO_RETRY
from exporter.remote.waiting import with_checkpoint
from tests.unit.remote.test_client import ADMIN, OK_ENGINES, URL, client_with


def sent_to(http: Any) -> list[tuple[str, dict[str, str]]]:
    return [(s["url"], s["params"]) for s in http.sent]


def test_the_old_import_paths_still_name_the_same_values() -> None:
    assert client_module.ACTION_TIMEOUT_S == ACTION_TIMEOUT_S == 150.0
    assert client_module.RESET_TIMEOUT_S == RESET_TIMEOUT_S
    assert client_module.VERIFY_TIMEOUT_S == VERIFY_TIMEOUT_S


async def test_prepare_sends_the_mode_only_when_given_and_restore_nothing() -> None:
    client, http = client_with(*[(200, OK_ENGINES)] * 3)
    prepared = await client.checkpoint_prepare("abort")
    assert prepared.success and prepared.action == "checkpoint_prepare"
    await client.checkpoint_prepare()
    restored = await client.checkpoint_restore(idempotency_key="snap-1")
    assert restored.action == "checkpoint_restore"
    assert sent_to(http) == [
        (f"{ADMIN}/admin/checkpoint_prepare", {"mode": "abort"}),
        (f"{ADMIN}/admin/checkpoint_prepare", {}),  # the exporter's default: vLLM's "wait"
        (f"{ADMIN}/admin/checkpoint_restore", {}),
    ]
    assert all(s["method"] == "POST" and s["json"] is None for s in http.sent)
    assert [s["timeout_s"] for s in http.sent] == [ACTION_TIMEOUT_S] * 3
    assert http.sent[0]["retry"] is NO_RETRY  # no key: a state change is never repeated
    assert http.sent[2]["headers"]["Idempotency-Key"] == "snap-1"
    assert http.sent[2]["retry"] is client.retry


async def test_before_0_34_it_is_unsupported_and_a_rank_behind_a_partial_failure() -> None:
    unsupported = {
        "action": "checkpoint_prepare",
        "outcome": "unsupported",
        "engines": [{"engine": 0, "ok": False, "reason": "unsupported"}],
    }
    refused = {
        "action": "checkpoint_prepare",
        "outcome": "partial_failure",
        "engines": [
            {"engine": 0, "ok": True, "state": ["prepared", None]},
            {"engine": 1, "ok": False, "reason": "refused", "error": "requires an awake engine"},
        ],
    }
    client, _ = client_with((501, unsupported), (502, refused))
    with pytest.raises(Unsupported) as lacking:
        await client.checkpoint_prepare()
    assert lacking.value.status == 501 and lacking.value.result is not None
    with pytest.raises(PartialFailure) as partial:
        await client.checkpoint_prepare()
    assert str(partial.value) == "checkpoint_prepare: partial_failure (engine 1: refused)"
    rank = partial.value.result.failures[0]
    assert (rank.engine, rank.error) == ("1", "requires an awake engine")


async def test_the_gate_and_wait_take_the_checkpoint_condition() -> None:
    client, http = client_with((200, OK_ENGINES), (200, OK_ENGINES))
    assert (await client.gate(checkpoint="prepared", paused=True)).ok
    assert (await client.wait(checkpoint="running", timeout_s=5.0, interval_s=0.01)).ok
    assert sent_to(http) == [
        (f"{URL}/gate", {"paused": "true", "checkpoint": "prepared"}),
        (f"{URL}/gate", {"checkpoint": "running"}),
    ]


@pytest.mark.parametrize(
    ("conditions", "checkpoint", "says"),
    [
        ({}, "restoring", "must be 'prepared' or 'running'"),
        ({}, "Prepared", "must be 'prepared' or 'running'"),
        ({"checkpoint": "running"}, "prepared", "contradicts"),
    ],
)
async def test_a_checkpoint_the_gate_cannot_wait_on_is_refused_before_sending(
    conditions: dict[str, Any], checkpoint: str, says: str
) -> None:
    client, http = client_with()
    with pytest.raises(BadRequest, match=says):
        await client.wait(conditions, 5.0, checkpoint=checkpoint)  # type: ignore[arg-type]
    if not conditions:  # the gate takes the condition once, as its keyword
        with pytest.raises(BadRequest, match=says):
            await client.gate(checkpoint=checkpoint)  # type: ignore[arg-type]
    assert http.sent == []


def test_with_checkpoint_keeps_the_other_conditions() -> None:
    assert with_checkpoint({"drained": True}, None) == {"drained": True}
    assert with_checkpoint({"checkpoint": "prepared"}, "prepared") == {"checkpoint": "prepared"}
    assert with_checkpoint({"paused": True}, "running") == {"paused": True, "checkpoint": "running"}
