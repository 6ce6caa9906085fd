"""The exporter inside the process that owns an ``AsyncLLM`` (an RL trainer, a script).

``await start_exporter(llm, listen="127.0.0.1:19400")`` runs the same service ``serve`` runs
(poller, ``/metrics``, ``/status``, the page, ``/gate`` and the admin listener) in the caller's
running event loop, against the ``AsyncLLM``'s own engine-core client: per-engine truth without
a sidecar or a change to how the engines start. ``await service.stop()`` stops it; the
``AsyncLLM`` is the caller's and is never shut down here. No global state: two exporters over
two ``AsyncLLM``s in one process are two independent services.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from exporter.config.settings import DERIVED, ENV_PREFIX, ServeConfig, resolve_config
from exporter.control.runtime import Exporter
from exporter.error import ConfigError
from exporter.inprocess.vllm_facts import core_of
from exporter.web.app import RunningService, start_service

DEFAULT_LISTEN = "127.0.0.1:19400"
DEFAULT_ADMIN_LISTEN = "127.0.0.1:19401"
#: What ``settings`` may name: ``ServeConfig``'s fields (not the derived ones) and ``config``.
SETTING_NAMES = (frozenset(f.name for f in fields(ServeConfig)) - DERIVED) | {"config"}


def inprocess_config(environ: Mapping[str, str] | None = None, **settings: Any) -> ServeConfig:
    """The configuration of in-process mode: ``settings`` (``ServeConfig`` field names) over
    the ``VLLM_DP_EXPORTER_*`` environment over the config file (``VLLM_DP_EXPORTER_CONFIG``)
    over the defaults, checked as ``serve`` checks its own. ``ConfigError`` when invalid."""
    unknown = sorted(set(settings) - SETTING_NAMES)
    if unknown:  # resolve_config ignores names it does not know: a typo would be silent
        raise ConfigError(f"in-process mode: unknown setting {', '.join(map(repr, unknown))}")
    env = os.environ if environ is None else environ
    return resolve_config(None, environ=env, **{**settings, "attach": "inprocess"})


async def start_exporter(
    engine_client: Any,
    *,
    listen: str | None = None,
    admin_listen: str | None = None,
    environ: Mapping[str, str] | None = None,
    **settings: Any,
) -> RunningService:
    """Start the exporter against ``engine_client`` (vLLM's ``AsyncLLM``) in the running
    event loop, which must be the one that runs the ``AsyncLLM``.

    ``listen`` and ``admin_listen`` are ``HOST:PORT`` (port 0: any free port, see the returned
    service's ``url`` and ``admin_url``; ``admin_listen="off"``: no admin listener); when not
    given, ``VLLM_DP_EXPORTER_LISTEN`` / ``_ADMIN_LISTEN`` or else loopback (``127.0.0.1:19400``
    and ``127.0.0.1:19401``: a trainer's process is no public server). Other
    keyword arguments are settings by their ``ServeConfig`` names (``poll_interval=1.0``,
    ``admin_token_file=...``). Raises ``ConfigError`` (bad settings, a vLLM without what this
    mode needs, another event loop) or ``StartupError`` (a port in use), with nothing left
    running."""
    env = os.environ if environ is None else environ
    listen = listen or env.get(ENV_PREFIX + "LISTEN") or DEFAULT_LISTEN
    admin_listen = admin_listen or env.get(ENV_PREFIX + "ADMIN_LISTEN") or DEFAULT_ADMIN_LISTEN
    # Off the trainer's event loop (which runs its AsyncLLM): the settings name files.
    config = await asyncio.to_thread(
        inprocess_config, env, listen=listen, admin_listen=admin_listen, **settings
    )
    service = await start_service(config, Exporter(config, vllm=core_of(engine_client)))
    return service
