"""Dashboard row: what each rank is doing (docs/activity.md): its running and waiting requests,
whether it has work, the hung and routable timelines, and its progress (tokens computed, seconds
since the last one) with the stalled timeline."""

from __future__ import annotations

from dashboard.builders import (
    GREEN_RED,
    Layout,
    sel,
    stat,
    state_timeline,
    target,
    timeseries,
)

LEGEND = "engine {{engine}} ({{instance}})"
RUNNING, WAITING, HUNG = sel('state="running"'), sel('state="waiting"'), sel('state="hung"')
STALLED = sel('state="stalled"')


def _two_values(zero: tuple[str, str], one: tuple[str, str]) -> list[dict[str, object]]:
    """A 0/1 gauge's value mapping: (text, colour) for 0 and for 1."""
    return [
        {
            "type": "value",
            "options": {
                "0": {"index": 0, "text": zero[0], "color": zero[1]},
                "1": {"index": 1, "text": one[0], "color": one[1]},
            },
        }
    ]


def add_activity_rows(L: Layout) -> None:
    L.row("Activity: requests, hung, progress, routable")
    for selector, title, what in (
        (
            RUNNING,
            "Running requests per rank",
            'Requests each rank is running (vllm_dp_engine_requests{state="running"}), as vLLM '
            "last published them: HTTP mode from each server's /metrics (one target's ranks "
            "summed), relay and in-process mode from the DP coordinator's counts the front end "
            "routes by. No line where the counts are unknown (owner mode; a server run with "
            "--disable-log-stats): never drawn as 0.",
        ),
        (
            WAITING,
            "Waiting requests per rank",
            'Requests queued on each rank (vllm_dp_engine_requests{state="waiting"}): behind a '
            "full batch, or behind a paused scheduler (vLLM still routes to a paused rank). A "
            "queue on a rank that is not routable for 30 s fires "
            "VllmDpRequestsOnUnroutableEngine. No line where the counts are unknown.",
        ),
    ):
        L.add(
            timeseries(
                title,
                what,
                [target(f"vllm_dp_engine_requests{selector}", LEGEND)],
                unit="short",
            ),
            w=9,
            h=7,
        )
    L.add(
        stat(
            "Requests waiting on unroutable ranks",
            "Requests queued on ranks that are not routable (paused, asleep, hung, silent or "
            "faulty: vllm_dp_engine_routable 0), summed per exporter: they run only once the "
            "rank is resumed, woken or recovers (runbook VllmDpRequestsOnUnroutableEngine). "
            "0 is healthy; ranks without published counts are not included.",
            [
                target(
                    f"sum by (instance) (vllm_dp_engine_requests{WAITING} "
                    f"and on (job, instance, engine) (vllm_dp_engine_routable{sel()} == 0)) "
                    f"or on (instance) (0 * sum by (instance) (vllm_dp_engine_routable{sel()}))",
                    "{{instance}}",
                    instant=True,
                )
            ],
            steps=GREEN_RED,
        ),
        w=6,
        h=7,
    )
    L.add(
        state_timeline(
            "Has work per rank",
            "vLLM's has_work per rank (vllm_dp_engine_has_work): requests in its scheduler, a "
            "batch queued or a DP wave running (HTTP mode over dev routes: running + waiting > 0 "
            "from /metrics). No work on every rank is what GET /gate?drained=true waits for "
            "before a weight update. Empty where unknown or unsupported (a vLLM without "
            "has_work, a server without request metrics): never shown as no work.",
            [target(f"vllm_dp_engine_has_work{sel()}", LEGEND)],
            maps=_two_values(("no work", "green"), ("has work", "blue")),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=6,
    )
    L.add(
        state_timeline(
            "Routable per rank",
            "vllm_dp_engine_routable per rank: routable when it answered the last poll, is not "
            "hung or stalled, is awake, not paused, and no fault-tolerance status says "
            "otherwise. GET /routable gives the reasons; GET /readyz?engine=N answers 503 while "
            "it is not.",
            [target(f"vllm_dp_engine_routable{sel()}", LEGEND)],
            maps=_two_values(("not routable", "red"), ("routable", "green")),
            steps=[{"color": "text", "value": None}],
        ),
        w=12,
        h=7,
    )
    L.add(
        state_timeline(
            "Hung per rank",
            "Ranks whose connection is alive but that answered no call for --hung-after "
            '(vllm_dp_engine_state{state="hung"}): a wedged busy loop or collective while '
            "vLLM's /health stays 200. A rank that answers late once is not hung; nor is a "
            "disconnected or dead one. VllmDpEngineHung fires after a minute.",
            [
                target(
                    f"max by (instance, engine) (vllm_dp_engine_state{HUNG})",
                    LEGEND,
                )
            ],
            maps=_two_values(("not hung", "green"), ("hung", "red")),
            steps=[{"color": "text", "value": None}],
        ),
        w=12,
        h=7,
    )
    L.add(
        timeseries(
            "Seconds without an answer",
            "vllm_dp_engine_unresponsive_seconds: 0 while the rank answers (or is "
            "disconnected), otherwise seconds since its last answer. Among several hung ranks, "
            "the one silent longest is usually where the hang started.",
            [target(f"vllm_dp_engine_unresponsive_seconds{sel()}", LEGEND)],
            unit="s",
        ),
        w=24,
        h=6,
    )
    L.add(
        timeseries(
            "Tokens computed per rank (tokens/s)",
            "Per-rank progress: the rate of vllm_dp_engine_progress_tokens_total, the tokens "
            "each rank computed, prompt plus generated (in-process: vLLM's stat loggers; HTTP: "
            "vLLM's vllm:prompt_tokens_total + vllm:generation_tokens_total). Prompt tokens count "
            "when a prefill completes, so a long prefill shows as 0 until it ends. A rank at 0 "
            "while it has work and its neighbours compute is stalling. No line where no source "
            "tells (owner and relay mode): never drawn as 0.",
            [
                target(
                    "sum by (instance, engine) "
                    f"(rate(vllm_dp_engine_progress_tokens_total{sel()}[$__rate_interval]))",
                    LEGEND,
                )
            ],
            unit="short",
        ),
        w=12,
        h=7,
    )
    L.add(
        timeseries(
            "Seconds since the last computed token",
            "vllm_dp_engine_last_progress_age_seconds: seconds, at the last poll, since the "
            "rank's computed tokens last grew (an idle rank's grows too: it is stalled only while "
            "it holds requests and has work). In in-process mode a rank that holds requests and "
            "has work reads stalled once this passes --stall-after (default 120 s). No line "
            "where no source tells.",
            [
                target(
                    f"max by (instance, engine) (vllm_dp_engine_last_progress_age_seconds{sel()})",
                    LEGEND,
                )
            ],
            unit="s",
        ),
        w=12,
        h=7,
    )
    L.add(
        state_timeline(
            "Stalled per rank",
            "Ranks that answer, are awake and not paused, hold requests and say they have work, "
            'but computed no token for --stall-after (vllm_dp_engine_state{state="stalled"}): a '
            "scheduler that holds requests it never schedules (blocked on a KV transfer, a "
            "deadlock). In-process mode only; HTTP mode shows progress but never calls a rank "
            "stalled. A hung or paused rank is not stalled. VllmDpEngineStalled fires after a "
            "minute.",
            [
                target(
                    f"max by (instance, engine) (vllm_dp_engine_state{STALLED})",
                    LEGEND,
                )
            ],
            maps=_two_values(("not stalled", "green"), ("stalled", "dark-orange")),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=6,
    )
