"""The in-process exporter inside vLLM's API server: started by the plugin, read by its routes.

``InProcessRuntime`` is created when vLLM builds its app (``attach_router``: the routes need a
handle) and started when vLLM initialises its state (``init_state``: the engine-core client
exists then). A start that fails (a bad ``VLLM_DP_EXPORTER_*`` setting, a vLLM without what
this mode needs, the render server's missing engine) is logged once and kept as ``problem``:
the routes answer 503 with it and vLLM serves on, never harmed by its monitor.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from exporter.base.logs import configure_embedded_logging
from exporter.base.steps import run_steps, run_steps_async
from exporter.base.tasks import cancel_and_wait, supervise
from exporter.config.settings import ServeConfig, env_warnings, secret_file_warnings
from exporter.control.runtime import Exporter
from exporter.control.sources import FollowerRead, PublishingRead, ReadingSource
from exporter.error import ExporterError
from exporter.inprocess.leader import ReadingFile
from exporter.inprocess.peer import audit_with_peer
from exporter.inprocess.shared import ProcessShare
from exporter.inprocess.trainer import inprocess_config
from exporter.inprocess.vllm_facts import ApiServer, api_server, core_of, multiprocess_dir
from exporter.metrics.exposition import text_steps
from exporter.metrics.families import Family
from exporter.metrics.renderer import OURS
from exporter.web.admin import AdminController

log = logging.getLogger("exporter.inprocess")

NOT_STARTED = "the dp_exporter plugin has not started yet (vLLM is still starting)"


class InProcessRuntime:
    """One API server process's exporter, admin controller and (several API servers) share."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        self.exporter: Exporter | None = None
        self.admin: AdminController | None = None
        self.share: ProcessShare | None = None
        self.server = ApiServer(0, 1)
        self.problem: str | None = NOT_STARTED
        self._share_task: asyncio.Task[None] | None = None
        #: The deployment's one reading (several API servers: API server 0 writes it).
        self.reading: ReadingFile | None = None

    async def start(self, engine_client: Any, args: Namespace | None) -> None:
        """Never raises (a monitor must not stop vLLM): a failure becomes ``problem``."""
        try:
            await self._start(engine_client, args)
        except (ExporterError, OSError) as exc:
            self.problem = f"the dp_exporter plugin did not start: {exc}"
            log.error("%s", self.problem)
        except Exception as exc:  # a bug, or a vLLM this mode does not know: logged whole
            self.problem = f"the dp_exporter plugin did not start: {type(exc).__name__}: {exc}"
            log.exception("the dp_exporter plugin did not start")

    async def _start(self, engine_client: Any, args: Namespace | None) -> None:
        if engine_client is None:
            raise ExporterError("this vLLM server has no engine (the render server)")
        # Off vLLM's event loop: the settings name files (token, config), and a slow read
        # must never stall vLLM's requests.
        config = await asyncio.to_thread(plugin_config, self._environ)
        if not logging.getLogger().handlers:  # vLLM configures its own logger only
            configure_embedded_logging(config.log_level, config.log_format)
        for warning in env_warnings(self._environ) + secret_file_warnings(config):
            log.warning("dp_exporter: %s", warning)
        self.server = api_server(engine_client, args)
        if config.load_publisher is not None and not self.server.leader:
            # Rank r's port is one per deployment: API server 0 binds them, the others would
            # find them taken.
            log.info("dp_exporter: the load publisher runs in API server 0 only")
            config = dataclasses.replace(config, load_publisher=None)
        exporter = Exporter(config, vllm=core_of(engine_client))
        directory = multiprocess_dir()
        if self.server.count > 1 and directory is not None:
            self.reading = ReadingFile(directory)
            exporter.poller.source = one_reader(exporter, self.server, self.reading)
        await exporter.start()
        admin = AdminController(
            exporter.action_parts(), audit=audit_with_peer
        )  # the peer, not a header's
        self.exporter, self.admin, self.problem = exporter, admin, None
        if self.server.count > 1 and directory is not None:
            self.share = ProcessShare(
                directory,
                self.server.index,
                exporter.collector.families,
                exporter.state_version,
                count=self.server.count,
                stale_s=max(60.0, 10 * config.poll_interval),
            )
            interval = min(1.0, config.poll_interval)
            self._share_task = supervise(
                "process_share", lambda: self.share_loop(interval), exporter.faults
            )
        log.info(
            "dp_exporter: per-engine polling of %d engines every %gs in API server %d of %d",
            len(exporter.client.engine_labels),
            config.poll_interval,
            self.server.index,
            self.server.count,
        )

    async def share_loop(self, interval_s: float) -> None:
        if self.share is not None:
            await self.share.run(interval_s)

    def families(self) -> list[Family] | None:
        """This process's families (on the loop), or None before a successful start."""
        return self.exporter.collector.families() if self.exporter is not None else None

    def merge(self, own: list[Family]) -> list[Family]:
        """``own`` with the other API servers' (blocking file reads: off the loop)."""
        return self.share.merged(own) if self.share is not None else own

    async def series(self) -> bytes | None:
        """The ``vllm_dp_*`` series as text (every API server's, merged), or None before a
        successful start. Built and written a step per turn of vLLM's event loop, and kept
        until the exporter's state changes (the exporter's ``renderer``): scrapes between two
        polls cost nothing, and none holds the loop that streams vLLM's tokens for long.
        With several API servers the merge reads files: it runs in a thread, with the
        encoding."""
        exporter = self.exporter
        if exporter is None:
            return None
        if self.share is None:
            return await run_steps_async(exporter.renderer.steps(OURS))
        own = await run_steps_async(exporter.collector.family_steps())
        return await asyncio.to_thread(lambda: run_steps(text_steps(self.merge(own))))

    async def stop(self) -> None:
        exporter, self.exporter = self.exporter, None
        task, self._share_task = self._share_task, None
        await cancel_and_wait(task)
        if self.share is not None:
            self.share.remove()
        if self.reading is not None and self.server.leader:
            self.reading.remove()
        if self.admin is not None and exporter is not None:
            await self.admin.drain(exporter.config.shutdown_grace)
        if exporter is not None:
            await exporter.stop()
        self.problem = "the dp_exporter plugin stopped (vLLM is shutting down)"


def one_reader(exporter: Exporter, server: ApiServer, reading: ReadingFile) -> ReadingSource:
    """API server 0 reads the engines and publishes each poll; the others follow it, and read
    the engines themselves only while its reading is missing or older than three polls (or a
    poll and two call timeouts). The gate keeps its own fresh reads in every process."""
    poller = exporter.poller
    if server.leader:
        return PublishingRead(poller.reader, reading.publish, server.index)
    config = exporter.config
    return FollowerRead(
        poller.reader,
        exporter.client,
        reading.load,
        max_age_s=max(3 * config.poll_interval, config.poll_interval + 2 * config.call_timeout),
    )


def plugin_config(environ: Mapping[str, str] | None = None) -> ServeConfig:
    """In-process settings from ``VLLM_DP_EXPORTER_*`` and the config file; the plugin opens
    no listener of its own (its routes are on vLLM's port), so listen and admin_listen and the
    web config (vLLM's port has vLLM's own TLS) are not used."""
    env = dict(os.environ if environ is None else environ)
    for name in ("WEB_CONFIG_FILE", "ADMIN_LISTEN", "LISTEN"):
        if env.pop("VLLM_DP_EXPORTER_" + name, None) is not None:
            log.warning("dp_exporter: VLLM_DP_EXPORTER_%s is not used inside vLLM", name)
    return inprocess_config(env, admin_listen="off")
