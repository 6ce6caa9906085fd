"""The two deployments several modules test against, each started once per session
(``conftest.py``'s ``owner_fleet`` and ``http_deployment`` fixtures):

* ``OwnerFleet``: the exporter owning the handshake of one headless launcher's 2 engines
  (scenarios 1, 2, 6 and 7b);
* ``HttpDeployment``: the exporter in HTTP mode over 2 single-engine API servers with
  ``VLLM_SERVER_DEV_MODE=1`` (scenarios 5 and 7a).
"""

from __future__ import annotations

from dataclasses import dataclass

from e2e.exporter_proc import ExporterProc, http_args, owner_args, start_exporter
from e2e.ports import HOST, free_port, free_port_range
from e2e.procs import Managed, ProcessGroup
from e2e.vllm_runtime import READY_TIMEOUT_S, VllmRuntime, wait_api_ready

HTTP_TARGETS = ("0", "1")


def start_engines(procs: ProcessGroup, runtime: VllmRuntime, handshake_port: int) -> Managed:
    return procs.start("vllm-engines", runtime.headless_engines(handshake_port), runtime.env())


@dataclass
class OwnerFleet:
    """The exporter owning the handshake of one launcher's 2 engines."""

    runtime: VllmRuntime
    procs: ProcessGroup
    handshake_port: int
    base_port: int
    exporter: ExporterProc
    engines: Managed

    def restart_exporter(self) -> None:
        """Stop the exporter and start it again on the same fixed and HTTP ports."""
        old = self.exporter
        assert old.proc.stop() is not None
        self.exporter = start_exporter(
            self.procs,
            "exporter",
            owner_args(self.handshake_port, self.base_port),
            listen_port=old.listen_port,
            admin_port=old.admin_port,
        )

    def restart_engines(self) -> None:
        self.engines = start_engines(self.procs, self.runtime, self.handshake_port)


def start_owner_fleet(runtime: VllmRuntime, procs: ProcessGroup) -> OwnerFleet:
    handshake_port, base_port = free_port(), free_port_range(3)
    # The exporter first: engines wait for the handshake address (5 min), not the reverse.
    exporter = start_exporter(procs, "exporter", owner_args(handshake_port, base_port))
    engines = start_engines(procs, runtime, handshake_port)
    exporter.wait_ready(READY_TIMEOUT_S, engines)
    return OwnerFleet(runtime, procs, handshake_port, base_port, exporter, engines)


@dataclass
class HttpDeployment:
    """Target name → its API server process and base URL; the exporter polling them."""

    servers: dict[str, Managed]
    urls: dict[str, str]
    exporter: ExporterProc


def start_http_deployment(runtime: VllmRuntime, procs: ProcessGroup) -> HttpDeployment:
    urls = {name: f"http://{HOST}:{free_port()}" for name in HTTP_TARGETS}
    servers = {
        name: procs.start(
            f"vllm-api-{name}",
            runtime.api_server(int(url.rsplit(":", 1)[1])),
            runtime.env({"VLLM_SERVER_DEV_MODE": "1"}),
        )
        for name, url in urls.items()
    }
    for url in urls.values():
        wait_api_ready(url, *servers.values())
    exporter = start_exporter(procs, "exporter", http_args(urls))
    exporter.wait_ready(READY_TIMEOUT_S, *servers.values())
    return HttpDeployment(servers, urls, exporter)
