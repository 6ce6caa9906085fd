"""``exporter.remote.Client`` against the real service (owner mode, simulated engines, real
HTTP): every admin action's typed result, and every way an action can fail, each as its own
error class with the per-engine outcomes where the exporter sent them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from exporter.remote import (
    AuthError,
    BadRequest,
    Client,
    Conflict,
    Credentials,
    IdempotencyKeyReused,
    NoEngineConnected,
    NotFound,
    PartialFailure,
    RateLimited,
    RemoteError,
    Secret,
    Unsupported,
)
from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually

TOKEN = "remote-token-3c4d5e6f7a8b"
CORRUPT = "model.layers.0.mlp.down_proj.weight"


def client(svc: Service, token: str | None = None, **kwargs: object) -> Client:
    creds = Credentials(Secret(token)) if token is not None else None
    return Client(svc.url, svc.admin_url, credentials=creds, **kwargs)  # type: ignore[arg-type]


async def test_every_action_answers_a_typed_result(fleet: ServiceFactory) -> None:
    svc = await fleet(3, options=SimOptions(weight_version="v1"), gate_min_interval=0.0)
    async with client(svc) as dp:
        paused = await dp.pause(mode="wait")
        assert (paused.action, paused.status, paused.success, paused.outcome) == (
            "pause",
            200,
            True,
            "success",
        )
        assert paused.verified is True and paused.params == {"mode": "wait"}
        assert [(e.engine, e.ok, e.reason, e.state) for e in paused.engines] == [
            (str(i), True, None, True) for i in range(3)
        ]
        assert paused.failed_engines == () and paused.failures == ()
        assert [e.args_of("pause_scheduler")[-1] for e in svc.engines] == [["wait"]] * 3

        asleep = await dp.sleep(level=2)
        assert asleep.params == {"level": 2, "mode": "abort"}
        assert [e.args_of("sleep")[-1] for e in svc.engines] == [[2]] * 3  # no mode unless asked
        assert all(e.state is True for e in asleep.engines)

        weights = await dp.wake_up(tags=["weights"])
        assert weights.verified is False and weights.params == {"tags": ["weights"]}
        assert all(e.state.sleeping_tags == {"kv_cache"} for e in svc.engines)
        awake = await dp.wake_up()
        assert awake.verified is True and all(e.state is False for e in awake.engines)

        reset = await dp.reset_prefix_cache(reset_running_requests=True)
        assert reset.action == "reset_prefix_cache" and reset.verified is None
        assert reset.params == {"reset_running_requests": True, "reset_connector": False}
        assert [e.args_of("reset_prefix_cache")[-1] for e in svc.engines] == [[True]] * 3
        for result in (await dp.reset_mm_cache(), await dp.reset_encoder_cache()):
            assert result.success and len(result.engines) == 3
        assert all(e.args_of("reset_encoder_cache") == [[]] for e in svc.engines)

        version = await dp.weight_version("step-2")
        assert [e.state for e in version.engines] == ["step-2"] * 3
        verified = await dp.verify_weights()
        assert [(e.ok, e.mismatches) for e in verified.engines] == [(True, 0)] * 3
        resumed = await dp.resume()
        assert resumed.engine(2).state is False and resumed.duration_s is not None

        opened = await dp.wait(
            {"weight_version": "step-2", "sleeping": False, "paused": False}, timeout_s=5
        )
        assert opened.ok and opened.status == 200
        assert [e.values["weight_version"] for e in opened.engines] == ["step-2"] * 3


@pytest.mark.parametrize("refusing", [0, 1, 2], ids=["first", "middle", "last"])
async def test_a_partial_failure_names_the_engine_wherever_it_is(
    fleet: ServiceFactory, refusing: int
) -> None:
    svc = await fleet(
        3,
        per_engine={"refuse_reset": {refusing: True}, "ignore_state_changes": {refusing: True}},
    )
    async with client(svc) as dp:
        with pytest.raises(PartialFailure) as caught:
            await dp.reset_prefix_cache()
        failure = caught.value
        assert not isinstance(failure, Unsupported)
        assert failure.status == 502 and failure.result.outcome == "partial_failure"
        assert failure.result.failed_engines == (str(refusing),)
        assert failure.result.engine(refusing).reason == "refused"
        assert [e.ok for e in failure.result.engines] == [i != refusing for i in range(3)]
        assert f"engine {refusing}: refused" in str(failure)

        with pytest.raises(PartialFailure) as caught:
            await dp.sleep()
        outcome = caught.value.result.engine(refusing)
        assert (outcome.ok, outcome.reason, outcome.state) == (False, "unverified", False)
        assert "is_sleeping is False" in (outcome.error or "")
    # Nothing rolled back: the other engines sleep.
    assert [e.state.sleeping_tags == set(ALL_TAGS) for e in svc.engines] == [
        i != refusing for i in range(3)
    ]


async def test_missing_methods_are_unsupported_and_mixed_failures_are_not(
    fleet: ServiceFactory,
) -> None:
    svc = await fleet(
        3,
        options=SimOptions(weight_version="v1"),
        per_engine={
            "missing_methods": {
                0: frozenset({"reset_encoder_cache", "reset_mm_cache"}),
                1: frozenset({"reset_encoder_cache"}),
                2: frozenset({"reset_encoder_cache", "reset_mm_cache", "reset_prefix_cache"}),
            },
            "refuse_reset": {0: True},
            "corrupt_param": {1: CORRUPT},
        },
    )
    async with client(svc) as dp:
        # No engine has it: 501, its own error (not a partial failure: nothing changed).
        with pytest.raises(Unsupported) as nowhere:
            await dp.reset_encoder_cache()
        assert not isinstance(nowhere.value, PartialFailure) and nowhere.value.status == 501
        assert nowhere.value.result is not None and nowhere.value.result.unsupported
        assert [e.reason for e in nowhere.value.result.engines] == ["unsupported"] * 3
        # Some engines have it: a partial failure naming the ones that do not.
        with pytest.raises(PartialFailure) as some:
            await dp.reset_mm_cache()
        assert some.value.status == 502 and not some.value.result.unsupported
        assert [e.engine for e in some.value.result.unsupported_engines] == ["0", "2"]
        with pytest.raises(PartialFailure) as mixed:
            await dp.reset_prefix_cache()
        assert [e.reason for e in mixed.value.result.engines] == ["refused", None, "unsupported"]
        with pytest.raises(PartialFailure) as mismatch:
            await dp.verify_weights()
        differs = mismatch.value.result.engine(1)
        assert differs.reason == "mismatch" and differs.mismatches == 1
        assert differs.mismatching_parameters[0].endswith(CORRUPT)


async def test_one_action_at_a_time_is_a_conflict(fleet: ServiceFactory) -> None:
    svc = await fleet(2)
    svc.engines[0].state.drain_s = 1.0  # pause(mode="wait") answers once in-flight work drained
    async with client(svc) as dp, client(svc) as other:
        running = asyncio.create_task(dp.pause(mode="wait", idempotency_key="pause-1"))
        await eventually(
            lambda: all(e.args_of("pause_scheduler") for e in svc.engines), 5, "pause sent"
        )
        with pytest.raises(Conflict) as busy:
            await other.resume()
        assert busy.value.status == 409 and "already running" in busy.value.detail
        with pytest.raises(Conflict) as same_key:
            await other.pause(mode="wait", idempotency_key="pause-1")
        assert "still running" in same_key.value.detail
        assert (await asyncio.wait_for(running, 10)).success
        replay = await other.pause(mode="wait", idempotency_key="pause-1")
        assert replay.replayed and replay.success
    assert [len(e.args_of("pause_scheduler")) for e in svc.engines] == [1, 1]
    assert [len(e.args_of("resume_scheduler")) for e in svc.engines] == [0, 0]


async def test_resets_within_the_minimum_interval_are_rate_limited(fleet: ServiceFactory) -> None:
    svc = await fleet(2, reset_min_interval=30)
    async with client(svc) as dp:
        assert (await dp.reset_prefix_cache()).success
        with pytest.raises(RateLimited) as limited:
            await dp.reset_prefix_cache()
    assert limited.value.status == 429
    assert limited.value.retry_after is not None and 0 < limited.value.retry_after <= 30
    assert "limited to one every 30s" in limited.value.detail


async def test_a_missing_or_wrong_token_is_an_auth_error(
    fleet: ServiceFactory, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    svc = await fleet(2, admin_token_file=str(token_file))
    for token in (None, "not-the-token"):
        async with client(svc, token) as dp:
            with pytest.raises(AuthError) as denied:
                await dp.resume()
        assert denied.value.status == 401 and "bearer token" in denied.value.detail
        assert TOKEN not in str(denied.value) and "not-the-token" not in repr(dp)
    creds = Credentials.load(token_file=str(token_file))
    async with Client(svc.url, svc.admin_url, credentials=creds) as dp:
        assert (await dp.resume()).success
        assert TOKEN not in repr(dp) + repr(creds) + str(creds.token)
        # Reads never carry the admin token: /status needs none.
        assert (await dp.status()).engines_connected == 2
    # Five failed tokens from this address (two above), then the next wrong one is throttled.
    async with client(svc, "wrong") as dp:
        errors: list[RemoteError] = []
        for _ in range(4):
            with pytest.raises(RemoteError) as caught:
                await dp.resume()
            errors.append(caught.value)
    assert [type(e) for e in errors] == [AuthError] * 3 + [RateLimited]
    assert isinstance(errors[-1], RateLimited) and errors[-1].retry_after is not None


async def test_rejected_requests_are_bad_requests(fleet: ServiceFactory) -> None:
    svc = await fleet(2)
    async with client(svc) as dp:
        with pytest.raises(BadRequest) as tags:
            await dp.wake_up("weights,dreams")
        assert tags.value.status == 400 and "tags" in tags.value.detail
        with pytest.raises(BadRequest) as level:
            await dp.sleep(level=7)
        assert "level" in level.value.detail
        with pytest.raises(BadRequest) as too_long:
            await dp.weight_version("v" * 300)
        assert "weight_version" in too_long.value.detail
        for key in ("", "x" * 201, "line\nbreak"):  # refused before anything is sent
            with pytest.raises(BadRequest) as bad_key:
                await dp.resume(idempotency_key=key)
            assert bad_key.value.status is None
        assert (await dp.weight_version("v7", idempotency_key="update-7")).success
        with pytest.raises(IdempotencyKeyReused) as reused:
            await dp.weight_version("v8", idempotency_key="update-7")
        assert isinstance(reused.value, BadRequest) and reused.value.status == 422
    # The metrics listener has no admin routes: aiohttp's own (non-JSON) 404.
    async with Client(svc.url, svc.url) as wrong:
        with pytest.raises(NotFound) as missing:
            await wrong.resume()
    assert missing.value.status == 404 and missing.value.body is None
    assert str(missing.value).startswith("HTTP 404: the answer is not JSON")
    assert [len(e.args_of("set_weight_version")) for e in svc.engines] == [1, 1]


async def test_idempotency_key_retries_get_the_first_answer(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=SimOptions(weight_version="v1"))
    async with client(svc) as dp:
        first = await dp.weight_version("v9", idempotency_key="update-9")
        again = await dp.weight_version("v9", idempotency_key="update-9")
    assert not first.replayed and again.replayed
    assert again.engines == first.engines and again.raw == first.raw
    assert [len(e.args_of("set_weight_version")) for e in svc.engines] == [1, 1]


async def test_no_engine_connected(fleet: ServiceFactory) -> None:
    svc = await fleet(2, start=False)
    async with client(svc) as dp:
        with pytest.raises(NoEngineConnected) as none:
            await dp.reset_prefix_cache()
        assert none.value.status == 503 and none.value.result is not None
        assert none.value.result.engines == () and none.value.result.error is not None
        closed = await dp.gate(paused=False)
        assert (closed.ok, closed.status, closed.error) == (False, 503, "no engine is connected")
