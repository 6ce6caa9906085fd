"""Dashboard rows: fleet verdict, engines, inconsistency."""

from __future__ import annotations

from dashboard.builders import (
    ENGINE_STATES,
    FLEET_STATES,
    FT_STATUSES,
    GREEN_RED,
    Layout,
    mappings,
    one_hot_code,
    panel,
    sel,
    stat,
    state_timeline,
    target,
    thresholds,
    timeseries,
)


def add_fleet_rows(L: Layout) -> None:
    fleet_code = one_hot_code("vllm_dp_fleet_state", FLEET_STATES, "job, instance")
    engine_code = one_hot_code("vllm_dp_engine_state", ENGINE_STATES, "instance, engine")

    # ------------------------------------------------------------------ verdict at a glance
    L.row("Fleet verdict")
    L.add(
        stat(
            "Fleet verdict",
            "Aggregated is_sleeping consensus of the DP group from vllm_dp_fleet_state: consistent "
            "(every engine gave the same answer), inconsistent (engines that answered disagree: "
            "some asleep or paused, some awake) or unknown (some engine did not answer while the "
            "others agree). Unknown is never shown as inconsistent.",
            [target(fleet_code, "{{instance}}", instant=True)],
            maps=mappings(FLEET_STATES),
            text_mode="value_and_name",
            steps=[{"color": "text", "value": None}],
        ),
        w=6,
        h=5,
    )
    L.add(
        stat(
            "Engines connected / expected",
            "Engines that completed the start-up handshake (vllm_dp_engines_connected) and the "
            "fleet size the exporter is configured for (vllm_dp_engines_expected, --engine-count).",
            [
                target(f"vllm_dp_engines_connected{sel()}", "connected {{instance}}", "A"),
                target(f"vllm_dp_engines_expected{sel()}", "expected {{instance}}", "B"),
            ],
            color_mode="value",
            text_mode="value_and_name",
        ),
        w=5,
        h=5,
    )
    L.add(
        stat(
            "Engines missing or down",
            "Expected engines that never connected plus connected engines whose last utility call "
            "failed (expected - sum of vllm_dp_engine_up). 0 is healthy.",
            [
                target(
                    f"vllm_dp_engines_expected{sel()} - on (job, instance) "
                    f"sum by (job, instance) (vllm_dp_engine_up{sel()})",
                    "{{instance}}",
                )
            ],
            steps=GREEN_RED,
        ),
        w=4,
        h=5,
    )
    L.add(
        stat(
            "Aggregated sleeping",
            "vllm_dp_sleeping: the DP group's aggregated is_sleeping (asleep also covers paused "
            "schedulers). No value while the fleet is inconsistent or unknown.",
            [target(f"vllm_dp_sleeping{sel()}", "{{instance}}")],
            maps=[
                {
                    "type": "value",
                    "options": {
                        "0": {"index": 0, "text": "awake", "color": "green"},
                        "1": {"index": 1, "text": "asleep", "color": "blue"},
                    },
                }
            ],
            extra={"noValue": "n/a (inconsistent or unknown)"},
            steps=[{"color": "text", "value": None}],
        ),
        w=4,
        h=5,
    )
    L.add(
        stat(
            "Time since last poll",
            "Seconds since the exporter last finished polling every engine "
            "(time() - vllm_dp_last_poll_timestamp_seconds). Default poll interval is 5 s; above "
            "60 s the VllmDpExporterPollsStale alert fires.",
            [target(f"time() - vllm_dp_last_poll_timestamp_seconds{sel()}", "{{instance}}")],
            unit="s",
            steps=[
                {"color": "green", "value": None},
                {"color": "orange", "value": 15},
                {"color": "red", "value": 60},
            ],
        ),
        w=5,
        h=5,
    )
    L.add(
        state_timeline(
            "Fleet verdict over time",
            "History of vllm_dp_fleet_state per exporter: green consistent, red inconsistent, "
            "orange unknown.",
            [target(fleet_code, "{{instance}}")],
            maps=mappings(FLEET_STATES),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=5,
    )

    # ------------------------------------------------------------------ engines
    L.row("Engines")
    L.add(
        state_timeline(
            "Engine sleep state",
            "Per-engine state from vllm_dp_engine_state: awake, asleep, paused (scheduler paused; "
            "vLLM's is_sleeping is also true then), unknown (the engine did not answer), stalled "
            "(answers and holds requests, but computed no token for --stall-after; in-process "
            "mode only) or hung (connected, but no answer for --hung-after). "
            "Engines that switch at different times show where the fleet diverged.",
            [target(engine_code, "engine {{engine}} ({{instance}})")],
            maps=mappings(ENGINE_STATES),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=8,
    )
    L.add(
        state_timeline(
            "Engine up",
            "vllm_dp_engine_up per engine: 1 when the engine answered its last utility call, 0 "
            "when "
            "it failed, timed out or is disconnected.",
            [target(f"vllm_dp_engine_up{sel()}", "engine {{engine}} ({{instance}})")],
            maps=[
                {
                    "type": "value",
                    "options": {
                        "0": {"index": 0, "text": "down", "color": "red"},
                        "1": {"index": 1, "text": "up", "color": "green"},
                    },
                }
            ],
            steps=[{"color": "text", "value": None}],
        ),
        w=12,
        h=7,
    )
    L.add(
        panel(
            "table",
            "Engines",
            "One row per engine from its start-up registration (vllm_dp_engine_info): vLLM version "
            "and whether sleep mode is enabled, plus the exporter build "
            "(vllm_dp_exporter_build_info).",
            [
                target(
                    f"vllm_dp_engine_info{sel()}",
                    "",
                    "A",
                    format="table",
                    instant=True,
                    range=False,
                ),
                target(
                    f"vllm_dp_exporter_build_info{sel()}",
                    "",
                    "B",
                    format="table",
                    instant=True,
                    range=False,
                ),
            ],
            options={"showHeader": True, "cellHeight": "sm"},
            extra={"custom": {"align": "auto", "filterable": True}},
        ),
        w=12,
        h=7,
    )
    ft_code = one_hot_code(
        "vllm_dp_engine_fault_tolerance_status", FT_STATUSES, "instance, engine", "status"
    )
    L.add(
        state_timeline(
            "Fault tolerance per rank",
            "vLLM's fault-tolerance sentinel (--enable-fault-tolerance, vLLM 0.33+) per engine, "
            "from vllm_dp_engine_fault_tolerance_status: healthy, unhealthy (its busy loop "
            "raised; it waits for POST /fault_tolerance/apply) or dead; diagnosing (vLLM 0.34: "
            "faulted, its mask being read before it goes unhealthy); paused and recovering "
            "(vLLM PR #41438); other (a status the exporter does not know, named in /status); "
            "unknown (not readable, or lost). Empty while no engine reported (fault tolerance "
            "off, or relay mode). vLLM's /health stays 200 meanwhile.",
            [target(ft_code, "engine {{engine}} ({{instance}})")],
            maps=mappings(FT_STATUSES),
            steps=[{"color": "text", "value": None}],
        ),
        w=24,
        h=6,
    )

    # ------------------------------------------------------------------ inconsistency
    L.row("Inconsistency")
    L.add(
        timeseries(
            "Inconsistent results",
            "Aggregated utility calls (polls) in which the engines that answered disagreed, per "
            "method (increase of vllm_dp_inconsistent_utility_results_total). A poll or two "
            "around a "
            "sleep/wake transition is normal; a steady stream is not.",
            [
                target(
                    f"sum by (method) (increase(vllm_dp_inconsistent_utility_results_total{sel()}"
                    f"[$__rate_interval]))",
                    "{{method}}",
                )
            ],
            bars=True,
            steps=GREEN_RED,
            unit="short",
        ),
        w=16,
        h=7,
    )
    L.add(
        stat(
            "Inconsistent polls in range",
            "Polls that found disagreeing engines during the dashboard's time range, and their "
            "share "
            "of all polls (vllm_dp_polls_total).",
            [
                target(
                    f"sum(increase(vllm_dp_inconsistent_utility_results_total{sel()}[$__range]))",
                    "inconsistent polls",
                    "A",
                    instant=True,
                ),
                target(
                    f"sum(increase(vllm_dp_inconsistent_utility_results_total{sel()}[$__range])) / "
                    f"sum(increase(vllm_dp_polls_total{sel()}[$__range]))",
                    "share of polls",
                    "B",
                    instant=True,
                ),
            ],
            color_mode="value",
            text_mode="value_and_name",
            steps=GREEN_RED,
            overrides=[
                {
                    "matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [
                        {"id": "unit", "value": "percentunit"},
                        {
                            "id": "thresholds",
                            "value": thresholds(
                                [
                                    {"color": "green", "value": None},
                                    {"color": "orange", "value": 0.1},
                                    {"color": "red", "value": 0.25},
                                ]
                            ),
                        },
                    ],
                }
            ],
        ),
        w=8,
        h=7,
    )

    # ------------------------------------------------------------------ prefix-cache resets
