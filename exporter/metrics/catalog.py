"""The one list of every metric the exporter publishes.

The collector, the docs test, the dashboard test and the alert-rule test all read this list,
so a metric cannot be renamed in one place and forgotten in another.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.metrics.labels import (
    ADMIN_ACTIONS as ADMIN_ACTIONS,
)
from exporter.metrics.labels import (
    CALL_OUTCOMES as CALL_OUTCOMES,
)
from exporter.metrics.labels import (
    CHECKPOINT_STATES as CHECKPOINT_STATES,
)
from exporter.metrics.labels import (  # re-exported: the catalog names its label values
    ENGINE_STATES as ENGINE_STATES,
)
from exporter.metrics.labels import (
    FLEET_STATES as FLEET_STATES,
)
from exporter.metrics.labels import (
    INFO_FACTS as INFO_FACTS,
)
from exporter.metrics.labels import (
    RESET_FAILURE_REASONS as RESET_FAILURE_REASONS,
)
from exporter.metrics.labels import (
    RESET_OUTCOMES as RESET_OUTCOMES,
)
from exporter.metrics.labels import (
    UNKNOWN_FACT as UNKNOWN_FACT,
)

PREFIX = "vllm_dp_"


@dataclass(frozen=True)
class MetricSpec:
    """Name (as scraped, counters with their ``_total``), type, labels and user-facing help."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    labels: tuple[str, ...]
    help: str
    modes: tuple[str, ...] = ("owner", "relay", "http", "inprocess")
    #: A gauge of *when* something happened: several API server processes' values are merged
    #: as the latest (``exporter.metrics.merge``), not taken from API server 0 alone.
    latest: bool = False
    #: A gauge of *how long since* something happened: merged as the least of every process.
    least: bool = False

    @property
    def family(self) -> str:
        """The family name prometheus_client uses (counters without ``_total``)."""
        if self.kind == "counter" and self.name.endswith("_total"):
            return self.name[: -len("_total")]
        return self.name


METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "vllm_dp_engine_up",
        "gauge",
        ("engine",),
        "1 when the engine answered its last utility call, 0 when that call failed, "
        "timed out or the engine is disconnected.",
    ),
    MetricSpec(
        "vllm_dp_engine_sleeping",
        "gauge",
        ("engine",),
        "The engine's last is_sleeping answer (1 asleep or paused, 0 awake); "
        "absent while the engine's state is unknown.",
    ),
    MetricSpec(
        "vllm_dp_engine_paused",
        "gauge",
        ("engine",),
        "The engine's last is_scheduler_paused answer (1/0); absent while unknown or "
        "when the engine's vLLM version does not support it.",
    ),
    MetricSpec(
        "vllm_dp_engine_checkpoint_state",
        "gauge",
        ("engine", "state"),
        "1 for the engine's process-checkpoint state (running, preparing, prepared, restoring, "
        "failed; vLLM 0.34's checkpoint_state), 0 for the others; absent for an engine that "
        "lacks it (an older vLLM) or did not answer the last poll.",
    ),
    MetricSpec(
        "vllm_dp_engine_state",
        "gauge",
        ("engine", "state"),
        "1 for the engine's current state (awake, asleep, paused, stalled, hung, unknown), 0 "
        "for the others: one series per state, for timelines. hung: its connection is alive "
        "but it answered no call for --hung-after seconds; stalled: it answers, holds "
        "requests and says it has work, but computed no token for --stall-after seconds "
        "(in-process mode only; docs/activity.md).",
    ),
    MetricSpec(
        "vllm_dp_engine_unresponsive_seconds",
        "gauge",
        ("engine",),
        "Seconds since the engine last answered any call while its connection is alive (0 "
        "while it answers, or while it is disconnected: then it is not hung).",
    ),
    MetricSpec(
        "vllm_dp_engine_progress_tokens_total",
        "counter",
        ("engine",),
        "Tokens the engine computed, prompt plus generated, as its source counts them "
        "(in-process: vLLM's stat loggers since the exporter started; HTTP: vLLM's per-engine "
        "vllm:prompt_tokens_total + vllm:generation_tokens_total). Absent where no source "
        "tells (owner, relay; docs/activity.md).",
        modes=("http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_engine_last_progress_age_seconds",
        "gauge",
        ("engine",),
        "Seconds, at the last poll, since the engine's computed tokens last grew (until they "
        "first grow: since the exporter first read them). Absent where no source tells.",
        modes=("http", "inprocess"),
        least=True,
    ),
    MetricSpec(
        "vllm_dp_engine_routable",
        "gauge",
        ("engine",),
        "1 when the engine should take traffic: it answered the last poll, is not hung or "
        "stalled, is awake, not paused, and no fault-tolerance status says otherwise (GET "
        "/routable).",
    ),
    MetricSpec(
        "vllm_dp_engine_has_work",
        "gauge",
        ("engine",),
        "The engine's last has_work answer (1/0): requests in its scheduler, a batch queued "
        "or a DP wave running (HTTP mode: running + waiting > 0 from vLLM's /metrics, or each "
        "rank's own answer through a /dp target); absent while unknown or unsupported "
        "(docs/activity.md).",
    ),
    MetricSpec(
        "vllm_dp_engine_requests",
        "gauge",
        ("engine", "state"),
        "The engine's requests as vLLM last published them: state running or waiting (queued, "
        "e.g. behind a paused scheduler). Relay and in-process: the DP coordinator's counts the "
        "front end routes by; HTTP: vLLM's /metrics. Absent where unknown (owner mode; no "
        "coordinator).",
        modes=("relay", "http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_engine_last_success_timestamp_seconds",
        "gauge",
        ("engine",),
        "Unix time of the engine's last successful is_sleeping answer.",
    ),
    MetricSpec(
        "vllm_dp_engine_info",
        "gauge",
        ("engine", *INFO_FACTS),
        "Always 1; labels from the engine's start-up registration message (unknown for a key "
        "that engine's vLLM does not send: 0.20 sends none of these).",
    ),
    MetricSpec(
        "vllm_dp_engine_fault_tolerance_status",
        "gauge",
        ("engine", "status"),
        "State set (healthy, unhealthy, dead, paused, recovering, diagnosing, other, unknown): "
        "the engine's last status from vLLM's fault-tolerance sentinel (--enable-fault-tolerance; "
        "paused and recovering from vLLM PR #41438, diagnosing from vLLM 0.34: faulted, its "
        "all2all mask being read); other for a status string the exporter "
        "does not know (the string in /status fault_info, never a label); unknown when the "
        "exporter cannot read it or lost it (a restart without --state-file); only healthy is "
        "healthy; absent while it never reported.",
        modes=("owner", "http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_fault_tolerance_faulty_engines",
        "gauge",
        (),
        "Engines whose last fault-tolerance status is anything but healthy (0: every rank "
        "that reported is healthy); absent until some engine reported a status.",
        modes=("owner", "http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_engine_pushes_total",
        "counter",
        ("engine", "kind"),
        "Messages an engine sent unasked with vLLM's reserved call ids, by kind "
        "(fault_tolerance_status, elastic_ep, other); never protocol errors. Owner mode only: "
        "engines push to client 0, the front end in relay mode.",
        modes=("owner",),
    ),
    MetricSpec(
        "vllm_dp_engine_membership_event_timestamp_seconds",
        "gauge",
        ("engine", "event"),
        "Unix time of the engine's last elastic-EP notification (RECONFIGURE_FINISHED, "
        "SHUTDOWN_COMPLETE) since its handshake. Owner mode only (pushes go to client 0).",
        modes=("owner",),
        latest=True,
    ),
    MetricSpec(
        "vllm_dp_elastic_ep_operation",
        "gauge",
        ("target", "phase"),
        "State set (idle, preparing, committing, completed, failed, other): the elastic-EP "
        "operation's phase as the API server (target) last reported it (POST "
        "/is_scaling_elastic_ep; vLLM 0.32: committing while scaling, else idle); absent while "
        "not read or unreadable, and where the server has no such route (owner and relay mode: "
        "no API server to ask).",
        modes=("http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_elastic_ep_epoch",
        "gauge",
        ("target",),
        "The operation's epoch, when the server reports one that is a whole number (vLLM's "
        "own are UUIDs: /status only).",
        modes=("http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_elastic_ep_requested_data_parallel_size",
        "gauge",
        ("target",),
        "The data-parallel size the operation asked for, while the server reports it.",
        modes=("http", "inprocess"),
    ),
    MetricSpec(
        "vllm_dp_engine_weight_version_info",
        "gauge",
        ("engine", "weight_version"),
        "Always 1; the engine's last get_weight_version answer as a label (empty when never "
        "set); absent while unknown or unsupported by the engine's vLLM version.",
    ),
    MetricSpec(
        "vllm_dp_weight_version_consistent",
        "gauge",
        (),
        "1 when every engine reports the same weight version, 0 when they disagree; absent "
        "while unknown.",
    ),
    MetricSpec(
        "vllm_dp_sleeping",
        "gauge",
        (),
        "Aggregated is_sleeping of the whole DP group (1/0); absent while the engines "
        "disagree or some engine's state is unknown.",
    ),
    MetricSpec(
        "vllm_dp_sleep_state_consistent",
        "gauge",
        (),
        "1 when every engine gave the same is_sleeping answer, 0 when they disagree; "
        "absent while unknown.",
    ),
    MetricSpec(
        "vllm_dp_fleet_state",
        "gauge",
        ("state",),
        "1 for the fleet's current verdict (consistent, inconsistent, unknown), 0 for the others.",
    ),
    MetricSpec(
        "vllm_dp_inconsistent_utility_results_total",
        "counter",
        ("method",),
        "Polls (aggregated calls) in which the engines that answered disagreed.",
    ),
    MetricSpec(
        "vllm_dp_utility_calls_total",
        "counter",
        ("method", "engine", "outcome"),
        "Utility calls sent to one engine, by outcome (ok, failed, timeout, "
        "disconnected; inconsistent for an HTTP target whose own engines disagree).",
    ),
    MetricSpec(
        "vllm_dp_utility_call_duration_seconds",
        "histogram",
        ("method",),
        "Round trip of one engine's utility call, in seconds.",
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_resets_total",
        "counter",
        ("outcome",),
        "Admin prefix-cache resets, by outcome: success (every engine confirmed), "
        "partial_failure (some did not), failure (none did or no engine connected), "
        "unsupported (no engine has the method or route).",
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_reset_engine_failures_total",
        "counter",
        ("engine", "reason"),
        "Engines that did not confirm a prefix-cache reset, by reason (refused, "
        "failed, timeout, disconnected; unsupported where that vLLM has no such method).",
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_reset_duration_seconds",
        "histogram",
        (),
        "End-to-end duration of an admin prefix-cache reset across all engines.",
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_last_success_timestamp_seconds",
        "gauge",
        (),
        "Unix time of the last prefix-cache reset that every engine confirmed.",
        latest=True,
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_last_reset_timestamp_seconds",
        "gauge",
        ("engine",),
        "Unix time (the exporter's clock, taken once the engine had confirmed, so never before "
        "the reset) of the engine's last confirmed prefix-cache reset, whatever action ran it: "
        "an admin reset it answered true, or a pause or a sleep at level 1 or 2 it accepted "
        "(vLLM 0.32 and 0.33 reset the cache in both). A KV-index consumer drops the rank's "
        "entries older than this even when AllBlocksCleared never arrived. Absent until the "
        "first since the exporter started.",
        latest=True,
    ),
    MetricSpec(
        "vllm_dp_prefix_cache_confirmed_resets_total",
        "counter",
        ("engine",),
        "Prefix-cache resets the engine confirmed, whatever action ran them (the admin reset, "
        "a pause, a sleep at level 1 or 2; see vllm_dp_prefix_cache_last_reset_timestamp_"
        "seconds). Refused, failed and timed-out calls are not counted.",
    ),
    MetricSpec(
        "vllm_dp_admin_actions_total",
        "counter",
        ("action", "outcome"),
        "Completed admin actions (sleep, wake_up, pause, resume, weight_version, cache resets, "
        "verify_weights), by outcome: success (every engine confirmed and, where readable, "
        "shows the state), partial_failure, failure, unsupported (no engine supports it: an "
        "older vLLM, or engines registered without sleep mode; nothing was sent or changed).",
    ),
    MetricSpec(
        "vllm_dp_admin_action_engine_failures_total",
        "counter",
        ("action", "engine", "reason"),
        "Engines that did not confirm an admin action, by reason (refused, failed, timeout, "
        "disconnected, unsupported, unverified: accepted but the state read back differs).",
    ),
    MetricSpec(
        "vllm_dp_weight_checksum_mismatches",
        "gauge",
        ("engine",),
        "Parameters whose weight checksum differs from the majority of DP ranks, in the last "
        "verify_weights; absent before the first, and for an engine none of whose checksums "
        "could be compared (digests of empty input: unverifiable, never 0).",
    ),
    MetricSpec(
        "vllm_dp_engines_expected",
        "gauge",
        (),
        "Number of engines (or HTTP targets) the exporter is configured to watch.",
    ),
    MetricSpec(
        "vllm_dp_engines_connected",
        "gauge",
        (),
        "Number of engines connected: handshaken and registered, or reattached after an "
        "exporter restart with their connection back (up only once they answer).",
    ),
    MetricSpec(
        "vllm_dp_protocol_errors_total",
        "counter",
        ("kind",),
        "Frames or peers the exporter rejected (malformed frames, unknown identities, "
        "unknown call ids, duplicate HELLO, ...).",
    ),
    MetricSpec(
        "vllm_dp_task_failures_total",
        "counter",
        ("task",),
        "Background tasks (handshake loop, poller, readers, ...) that raised unexpectedly; "
        "each was logged and restarted.",
    ),
    MetricSpec(
        "vllm_dp_http_bad_requests_total",
        "counter",
        ("listener",),
        "Malformed HTTP requests (bad request line, header or version) answered 400 before any "
        "route ran, by listener (metrics, admin); logged at most once a minute per listener.",
    ),
    MetricSpec(
        "vllm_dp_poll_duration_seconds",
        "gauge",
        (),
        "How long the last poll of every engine took, in seconds.",
    ),
    MetricSpec(
        "vllm_dp_last_poll_timestamp_seconds",
        "gauge",
        (),
        "Unix time at which the last poll finished.",
    ),
    MetricSpec(
        "vllm_dp_polls_total", "counter", (), "Polls the exporter has run since it started."
    ),
    MetricSpec(
        "vllm_dp_admin_requests_total",
        "counter",
        ("action", "code"),
        "Requests to the admin listener, by action and HTTP status code.",
    ),
    MetricSpec(
        "vllm_dp_relay_handshakes_total",
        "counter",
        ("result",),
        "Engine handshakes relayed to the upstream front end, by result.",
        modes=("relay",),
    ),
    MetricSpec("vllm_dp_watchers", "gauge", (), "Clients reading GET /watch now."),
    MetricSpec(
        "vllm_dp_watch_events_total",
        "counter",
        (),
        "Rank rows that changed and were sent to GET /watch (one per change, whatever the "
        "number of watchers).",
    ),
    MetricSpec(
        "vllm_dp_watch_dropped_total",
        "counter",
        (),
        "GET /watch clients dropped because they fell a whole queue behind (they resume "
        "with Last-Event-ID).",
    ),
    MetricSpec(
        "vllm_dp_watch_refused_total",
        "counter",
        (),
        "GET /watch connections refused with 503 beyond --max-watchers.",
    ),
    MetricSpec(
        "vllm_dp_load_messages_total",
        "counter",
        ("topic",),
        "Messages the ZMQ load publisher (--load-publisher) handed to ZMQ, by topic (load, "
        "rank_state): changes and the once-a-second re-sends.",
    ),
    MetricSpec(
        "vllm_dp_load_send_failures_total",
        "counter",
        ("topic",),
        "Load publisher sends that failed (never raised; what a slow subscriber loses at the "
        "high-water mark is not counted: it sees the gap in seq).",
    ),
    MetricSpec(
        "vllm_dp_load_bind_failures_total",
        "counter",
        (),
        "Ranks whose load publisher port could not be bound (taken, not permitted, past "
        "65535): logged once, shown in /status, the other ranks publish on.",
    ),
    MetricSpec(
        "vllm_dp_late_replies_total",
        "counter",
        ("engine",),
        "Replies to a utility call the exporter had given up on (it timed out): a busy or "
        "recovering engine answering what was queued, not a protocol error (owner, relay).",
        modes=("owner", "relay"),
    ),
    MetricSpec(
        "vllm_dp_state_file_writes_total",
        "counter",
        ("outcome",),
        "Writes of the --state-file, by outcome (ok, failed: logged once per reason); a restarted "
        "exporter finds its engines only in the last written file. 0 without --state-file.",
        modes=("owner", "relay"),
    ),
    MetricSpec(
        "vllm_dp_exporter_build_info", "gauge", ("version",), "Always 1; the exporter's version."
    ),
)

BY_NAME = {spec.name: spec for spec in METRICS}


def sample_names(spec: MetricSpec) -> tuple[str, ...]:
    """Every sample name a family produces in the text format."""
    if spec.kind == "histogram":
        return (f"{spec.name}_bucket", f"{spec.name}_sum", f"{spec.name}_count")
    if spec.kind == "counter":
        return (spec.name, f"{spec.family}_created")
    return (spec.name,)
