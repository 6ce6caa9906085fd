"""A running exporter from Python: every admin action, the gate and ``/status``, with typed
per-engine results and typed errors, sync (``SyncClient``) and async (``Client``).

An RL training loop drives every DP rank without a subprocess and without parsing exit codes::

    from exporter.remote import Credentials, PartialFailure, SyncClient

    creds = Credentials.load(token_file="/run/secrets/admin-token")
    with SyncClient("http://127.0.0.1:19400", "http://127.0.0.1:19401", credentials=creds) as dp:
        dp.pause(mode="wait")
        dp.sleep(level=1)
        ...  # train, push the weights
        dp.wake_up()
        dp.reset_prefix_cache()
        dp.weight_version(version)
        dp.resume()
        dp.wait({"weight_version": version, "sleeping": False, "paused": False}, timeout_s=300)

``dp.wait(drained=True, timeout_s=60)`` holds until every rank has finished its work (vLLM's
``has_work`` false, no running or waiting request published); ``dp.status()`` has each rank's
``has_work``, ``running``, ``waiting`` and ``drained``. A process snapshot (vLLM 0.34):
``dp.checkpoint_prepare(mode="wait")``, ``dp.wait(checkpoint="prepared")``, capture,
``dp.checkpoint_restore()``, ``dp.wait(checkpoint="running")``. ``dp.watch()`` follows the per-rank
feed (``GET /watch``): one ``WatchEvent`` per rank, then one per change, resumed by itself
after a dropped connection::

    with dp.watch() as events:
        for event in events:
            if event.kind == "rank" and not event.routable:
                print(event.engine, event.reasons)

Each action returns an ``ActionResult`` when every engine confirmed it, and raises
``PartialFailure`` (``.result.engines``: who did not, and why; nothing is rolled back) when
some did not; every other answer is an error of its own class (``Conflict``, ``RateLimited``,
``AuthError``, ``Unreachable``, ...; all ``RemoteError``, all ``exporter.error.ExporterError``).
``ctl`` is built on this package (docs/rl.md, "From Python: exporter.remote").
"""

from __future__ import annotations

from exporter.remote.answers import printable
from exporter.remote.client import (
    DEFAULT_ADMIN_URL,
    DEFAULT_URL,
    Client,
    PauseMode,
    WakeTag,
)
from exporter.remote.credentials import BASIC_AUTH_ENV, BasicAuth, Credentials, Secret
from exporter.remote.errors import (
    AuthError,
    BadRequest,
    Conflict,
    Forbidden,
    HttpError,
    IdempotencyKeyReused,
    InvalidAnswer,
    NoEngineConnected,
    NotFound,
    PartialFailure,
    RateLimited,
    RemoteError,
    Unreachable,
    Unsupported,
    WaitTimeout,
)
from exporter.remote.http import NO_RETRY, Retry
from exporter.remote.results import (
    ActionResult,
    EngineRequests,
    EngineResult,
    GateEngine,
    GateResult,
)
from exporter.remote.status import (
    ElasticEpOperationStatus,
    EngineInvariant,
    EngineStatus,
    Status,
    Verdict,
)
from exporter.remote.sync import SyncClient, SyncWatch
from exporter.remote.waiting import CheckpointGoal, Progress
from exporter.remote.watching import Reconnect, Reconnecting, Watch, WatchEvent, WatchRefused

__all__ = [
    "BASIC_AUTH_ENV",
    "DEFAULT_ADMIN_URL",
    "DEFAULT_URL",
    "NO_RETRY",
    "ActionResult",
    "AuthError",
    "BadRequest",
    "BasicAuth",
    "CheckpointGoal",
    "Client",
    "Conflict",
    "Credentials",
    "ElasticEpOperationStatus",
    "EngineInvariant",
    "EngineRequests",
    "EngineResult",
    "EngineStatus",
    "Forbidden",
    "GateEngine",
    "GateResult",
    "HttpError",
    "IdempotencyKeyReused",
    "InvalidAnswer",
    "NoEngineConnected",
    "NotFound",
    "PartialFailure",
    "PauseMode",
    "Progress",
    "RateLimited",
    "Reconnect",
    "Reconnecting",
    "RemoteError",
    "Retry",
    "Secret",
    "Status",
    "SyncClient",
    "SyncWatch",
    "Unreachable",
    "Unsupported",
    "Verdict",
    "WaitTimeout",
    "WakeTag",
    "Watch",
    "WatchEvent",
    "WatchRefused",
    "printable",
]
