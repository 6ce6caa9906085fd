"""The label values the exporter's series take (one place: the collector, the docs, the
dashboard and the alert rules read them through ``exporter.metrics.catalog``)."""

from __future__ import annotations

ENGINE_STATES = ("awake", "asleep", "paused", "stalled", "hung", "unknown")
#: vLLM 0.34's process-checkpoint states (``exporter.protocol.checkpoint``).
CHECKPOINT_STATES = ("running", "preparing", "prepared", "restoring", "failed")
#: Registration facts shown as ``vllm_dp_engine_info`` labels: one series per engine whatever
#: their values (a per-start ``instance_id`` is in /status only: it would add a series per
#: restart).
INFO_FACTS = (
    "vllm_version",
    "front_end",
    "rust_frontend_version",
    "enable_sleep_mode",
    "data_parallel_rank",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "dtype",
)
#: The label value of a registration fact the engine did not send.
UNKNOWN_FACT = "unknown"
FLEET_STATES = ("consistent", "inconsistent", "unknown")
CALL_OUTCOMES = ("ok", "failed", "timeout", "disconnected", "inconsistent")
#: Fleet outcomes of an admin action (``exporter.fleetstate.aggregate.fleet_outcome``).
RESET_OUTCOMES = ("success", "partial_failure", "failure", "unsupported")
RESET_FAILURE_REASONS = ("refused", "failed", "timeout", "disconnected")
#: Every admin action (exporter.actions, the prefix-cache reset, the weight verification).
ADMIN_ACTIONS = (
    "reset_prefix_cache",
    "sleep",
    "wake_up",
    "pause",
    "resume",
    "weight_version",
    "reset_mm_cache",
    "reset_encoder_cache",
    "verify_weights",
    "checkpoint_prepare",
    "checkpoint_restore",
)
