"""Every ``serve`` setting's flag: its field, how its text is read, and its help (pure data).

Each becomes ``--field-name`` and ``VLLM_DP_EXPORTER_FIELD_NAME`` (``exporter.config.settings``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exporter.base.eventloop import event_loop_value
from exporter.base.logs import log_format_value, log_level_value


def parse_switch(text: str) -> bool:
    """A boolean setting's text: true/false, 1/0, yes/no, on/off (any case)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


#: (field, type converter, help). Each becomes ``--field-name`` and ``VLLM_DP_EXPORTER_FIELD_NAME``.
OPTIONS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("attach", str, "owner (own the engines' handshake), relay, or http"),
    ("engine_count", int, "number of DP engines to attach to (owner/relay)"),
    (
        "handshake_address",
        str,
        "tcp://HOST:PORT the engines dial (--data-parallel-address/-rpc-port)",
    ),
    ("start_rank", int, "first engine index (DP rank) of this group"),
    ("advertise_host", str, "host the engines use to reach the exporter's input/output sockets"),
    ("bind_host", str, "host to bind the input/output sockets on (default: advertise host)"),
    ("fixed_base_port", int, "bind input at PORT and engine i's output at PORT+1+i (reattach)"),
    ("upstream_handshake_address", str, "relay mode: the vLLM front end's handshake address"),
    (
        "state_file",
        str,
        "where to remember engines (slots, vLLM versions) across exporter restarts",
    ),
    (
        "relay_upstream_timeout",
        float,
        "relay mode: seconds to wait for the front end's INIT (engines give up after 300)",
    ),
    ("http_target", str, "http mode: a vLLM API server URL, optionally NAME=URL (repeatable)"),
    ("http_targets_file", str, "http mode: file with one target per line"),
    ("http_token_file", str, "http mode: bearer token for the targets"),
    ("listen", str, "HOST:PORT of /metrics, /status, /healthz, /readyz"),
    ("admin_listen", str, "HOST:PORT of the admin endpoint ('off' to disable)"),
    ("admin_token_file", str, "file holding the admin bearer token"),
    ("poll_interval", float, "seconds between polls"),
    ("call_timeout", float, "seconds to wait for one engine's utility reply"),
    ("poll_jitter", float, "poll interval jitter as a fraction (0.1 = ±10%%)"),
    ("model_name", str, "adds a model_name label to every series"),
    ("reset_min_interval", float, "minimum seconds between two prefix-cache resets"),
    ("reset_timeout", float, "seconds to wait for reset replies (default: call timeout)"),
    ("shutdown_grace", float, "seconds an in-flight admin reset may take at shutdown"),
    (
        "action_timeout",
        float,
        "seconds to wait for an admin action's replies and its read-back (sleep, wake_up, ...)",
    ),
    ("verify_weights_timeout", float, "seconds to wait for every engine's weight checksums"),
    ("gate_min_interval", float, "GET /gate runs at most one fresh fan-out this often (seconds)"),
    ("max_watchers", int, "GET /watch: at most this many watchers at once (more get a 503)"),
    (
        "load_publisher",
        str,
        "tcp://HOST:BASE: publish each rank's load on ZMQ (rank r at BASE + r, SGLang's framing)",
    ),
    (
        "hung_after",
        float,
        "a connected rank that answered nothing for this long is hung (seconds; 0: three poll "
        "intervals, at least the call timeout)",
    ),
    (
        "stall_after",
        float,
        "a rank that holds requests, answers and says it has work, but computed no token for "
        "this long is stalled (seconds; above the longest prefill a rank runs; 0: never)",
    ),
    (
        "engines_per_burst",
        int,
        "a poll reads at most this many engines at once, the bursts spread evenly over the poll "
        "interval (0: every engine at once)",
    ),
    (
        "relay_allow_state_changes",
        parse_switch,
        "relay mode: allow sleep/wake_up/pause/resume/weight_version beside the front end",
    ),
    (
        "web_config_file",
        str,
        "exporter-toolkit web configuration (TLS, basic auth) for both listeners: docs/security.md",
    ),
    ("log_level", log_level_value, "log level"),
    ("log_format", log_format_value, "log format"),
    ("event_loop", event_loop_value, "auto (uvloop when installed), uvloop, or asyncio"),
    ("config", str, "config file (JSON, or TOML on Python 3.11+)"),
)
