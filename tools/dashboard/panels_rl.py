"""Dashboard rows: RL invariants (weight versions per engine, weight checksums) and the
collective admin actions (docs/rl.md)."""

from __future__ import annotations

from typing import Any

from dashboard.builders import (
    GREEN_RED,
    Layout,
    color_override,
    panel,
    sel,
    stat,
    target,
    timeseries,
)


def add_rl_rows(L: Layout) -> None:
    L.row("Weight versions and admin actions")
    versions = panel(
        "table",
        "Weight version per engine",
        "Each engine's last get_weight_version answer (vllm_dp_engine_weight_version_info; "
        "empty when never set, no row while unknown or unsupported by the engine's vLLM). "
        "After a weight update every engine of a DP group must show the same version.",
        [
            target(
                f"vllm_dp_engine_weight_version_info{sel()}",
                "",
                "A",
                format="table",
                instant=True,
                range=False,
            )
        ],
        options={"showHeader": True, "cellHeight": "sm"},
        extra={"custom": {"align": "auto", "filterable": True}},
    )
    versions["transformations"] = [
        {
            "id": "organize",
            "options": {
                "excludeByName": {"Time": True, "Value": True, "__name__": True},
                "indexByName": {"instance": 0, "engine": 1, "weight_version": 2},
            },
        }
    ]
    L.add(versions, w=10, h=7)
    L.add(
        stat(
            "Weight versions consistent",
            "vllm_dp_weight_version_consistent: consistent when every engine reports the same "
            "weight version, inconsistent when they disagree (VllmDpWeightVersionsInconsistent "
            "fires when it lasts), unknown while some engine's version is unknown.",
            [target(f"vllm_dp_weight_version_consistent{sel()}", "{{instance}}")],
            maps=[
                {
                    "type": "value",
                    "options": {
                        "0": {"index": 0, "text": "inconsistent", "color": "red"},
                        "1": {"index": 1, "text": "consistent", "color": "green"},
                    },
                }
            ],
            steps=[{"color": "text", "value": None}],
            extra={"noValue": "unknown"},
        ),
        w=4,
        h=7,
    )
    L.add(
        timeseries(
            "Weight checksum mismatches",
            "Parameters whose checksum differs from the majority of DP ranks, per engine, in the "
            "last POST /admin/verify_weights (vllm_dp_weight_checksum_mismatches; absent before "
            "the first verification). Anything above 0 means that rank serves other weights.",
            [
                target(
                    f"vllm_dp_weight_checksum_mismatches{sel()}",
                    "engine {{engine}} ({{instance}})",
                )
            ],
            show_thresholds=True,
            steps=GREEN_RED,
        ),
        w=10,
        h=7,
    )
    outcomes: list[dict[str, Any]] = [
        color_override(f"{action} {outcome}", color)
        for action in ("sleep", "wake_up", "pause", "resume", "weight_version")
        for outcome, color in (("partial_failure", "orange"), ("failure", "red"))
    ]
    L.add(
        timeseries(
            "Admin actions",
            "Collective admin actions by action and outcome (increase of "
            "vllm_dp_admin_actions_total): success (every engine confirmed and, where readable, "
            "shows the state afterwards), partial_failure (some engines did not: nothing is "
            "rolled back), failure (none did, or no engine connected).",
            [
                target(
                    f"sum by (action, outcome) (increase(vllm_dp_admin_actions_total{sel()}"
                    f"[$__rate_interval]))",
                    "{{action}} {{outcome}}",
                )
            ],
            bars=True,
            stack=True,
            overrides=outcomes,
        ),
        w=12,
        h=8,
    )
    L.add(
        timeseries(
            "Admin action failures by reason",
            "Engines that did not confirm an admin action, by action and reason (increase of "
            "vllm_dp_admin_action_engine_failures_total): refused, failed, timeout, "
            "disconnected, unsupported (no such method in that vLLM), unverified (accepted, but "
            "the state read back differs), mismatch (weight checksums differ from the majority).",
            [
                target(
                    f"sum by (instance, action, engine, reason) (increase("
                    f"vllm_dp_admin_action_engine_failures_total{sel()}[$__rate_interval]))",
                    "{{action}} engine {{engine}} {{reason}} ({{instance}})",
                )
            ],
            bars=True,
            stack=True,
            steps=GREEN_RED,
        ),
        w=12,
        h=8,
    )
