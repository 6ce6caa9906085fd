"""In-process mode's deployments for ``test_inprocess.py``: the ``dp_exporter`` plugin inside
``vllm serve``, ``vllm serve`` with the package installed but not allow-listed, and a
trainer's process running ``exporter.inprocess.start_exporter`` over its own ``AsyncLLM``.

Each needs the checkout installed in vLLM's environment (``e2e.plugin_install``). Every vLLM
process here runs in its log folder (not in the checkout, whose ``exporter/`` and stale
``*.egg-info`` must never shadow the installed package) with no ``VLLM_DP_EXPORTER_*`` from the
caller's environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e import web
from e2e.ports import HOST, free_port
from e2e.procs import Managed, ProcessGroup, first_exited
from e2e.vllm_runtime import READY_TIMEOUT_S, VllmRuntime, wait_api_ready

PLUGIN = "dp_exporter"
# vLLM's warning when an endpoint plugin is installed and VLLM_PLUGINS is unset (0.32).
NOT_ALLOWED_WARNING = f"Found endpoint plugin(s) ['{PLUGIN}'] but VLLM_PLUGINS is not set"
# How long the plugin's exporters (one per API server) may take to answer after /health.
PLUGIN_READY_S = 60.0
TRAINER_SCRIPT = Path(__file__).with_name("embedded_trainer.py")


def write_token(folder: Path) -> tuple[Path, str]:
    """An admin token file readable by its owner only (the exporter warns about any other)."""
    token = "e2e-" + os.urandom(16).hex()
    path = folder / "admin-token"
    path.write_text(token)
    path.chmod(0o600)
    return path, token


def vllm_env(
    runtime: VllmRuntime, plugins: str | None, settings: Mapping[str, str] | None = None
) -> dict[str, str]:
    """vLLM's environment with ``VLLM_PLUGINS`` exactly ``plugins`` (None: unset) and only
    the given ``VLLM_DP_EXPORTER_*`` settings (``{"POLL_INTERVAL": "1"}``)."""
    env = {
        k: v
        for k, v in runtime.env().items()
        if not k.startswith("VLLM_DP_EXPORTER_") and k != "VLLM_PLUGINS"
    }
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    env.update({f"VLLM_DP_EXPORTER_{k}": v for k, v in (settings or {}).items()})
    return env


@dataclass
class Endpoint:
    """HTTP calls to one exporter, however it is served: ``prefix`` is ``/dp`` on vLLM's own
    port (the plugin) and empty on a trainer's exporter listener."""

    url: str
    admin_url: str
    prefix: str
    token: str

    def status(self) -> dict[str, Any]:
        reply = web.get(f"{self.url}{self.prefix}/status")
        assert reply.status == 200, reply
        body: dict[str, Any] = reply.json()
        return body

    def scrape(self) -> web.Scrape:
        reply = web.get(f"{self.url}/metrics", timeout_s=30.0)
        assert reply.status == 200, reply
        return web.Scrape(reply.body.decode())

    def gate(self, **conditions: str) -> web.Reply:
        query = urllib.parse.urlencode(conditions)
        return web.get(f"{self.url}{self.prefix}/gate?{query}", timeout_s=30.0)

    def admin(
        self, action: str, payload: Any = None, token: str | None = "", **query: str
    ) -> web.Reply:
        """``POST <prefix>/admin/<action>`` with the bearer token (``token=None``: none at
        all, ``""``: the right one)."""
        url = f"{self.admin_url}{self.prefix}/admin/{action}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        bearer = self.token if token == "" else token
        headers = {"Authorization": f"Bearer {bearer}"} if bearer is not None else {}
        return web.request("POST", url, payload, timeout_s=60.0, headers=headers)

    def reset(self, reset_running_requests: bool = False) -> web.Reply:
        flag = "true" if reset_running_requests else "false"
        return self.admin("reset_prefix_cache", reset_running_requests=flag)


@dataclass
class PluginServer:
    """``vllm serve`` with DP engines and (or without) the plugin."""

    server: Managed
    api_url: str
    endpoint: Endpoint


def start_plugin_server(
    runtime: VllmRuntime,
    procs: ProcessGroup,
    token_file: Path,
    token: str,
    count: int = 2,
    *,
    settings: Mapping[str, str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    name: str = "vllm-serve-plugin",
) -> PluginServer:
    """``vllm serve --data-parallel-size count`` with ``VLLM_PLUGINS=dp_exporter`` polling every
    second; ready once vLLM answers ``/health`` and the plugin ``/dp/readyz``. ``settings``:
    more ``VLLM_DP_EXPORTER_*`` settings (``{"STALL_AFTER": "8"}``), ``extra_env`` more of
    the environment, ``extra_args`` more of ``vllm serve``'s flags."""
    port = free_port()
    api_url = f"http://{HOST}:{port}"
    env = vllm_env(
        runtime,
        PLUGIN,
        {
            "POLL_INTERVAL": "1",
            "ADMIN_TOKEN_FILE": str(token_file),
            "RESET_MIN_INTERVAL": "0",
            **(settings or {}),
        },
    )
    # Dev mode: vLLM's own /pause, /resume and /weight_info, used next to the plugin's routes.
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(extra_env or {})
    argv = runtime.data_parallel_server(port, count, *extra_args)
    server = procs.start(name, argv, env, cwd=procs.log_dir)
    wait_api_ready(api_url, server)
    endpoint = Endpoint(api_url, api_url, "/dp", token)
    wait_every_api_server(endpoint, count, server)
    # /metrics shows API server 0's gauges, from the file it rewrites about every second when
    # the other server answers: until then its last file may predate its first poll.
    web.wait_for(
        lambda: all(
            endpoint.scrape().value("vllm_dp_engine_up", engine=str(e)) == 1 for e in range(count)
        ),
        PLUGIN_READY_S,
        "vllm_dp_engine_up 1 for every engine on /metrics",
        abort=lambda: first_exited(server),
    )
    return PluginServer(server, api_url, endpoint)


def wait_every_api_server(endpoint: Endpoint, count: int, server: Managed) -> set[str]:
    """Until ``count`` API servers (vLLM's default: one per DP engine) each answered a
    ``/dp/status`` with every engine up. A request reaches one of them, whichever accepts
    first, and each one's exporter starts and polls on its own; the gauges of ``/metrics``
    are API server 0's, so one ready server is not enough. Returns the ``address``es seen
    (``in-process (vLLM client <index>)``)."""
    ready: set[str] = set()

    def probe() -> bool:
        reply = web.get(f"{endpoint.url}{endpoint.prefix}/status")
        if reply.status != 200:  # 503 while that server's plugin is still starting
            return False
        status = reply.json()
        engines = status["engines"]
        if status["ready"] and len(engines) == count and all(e["up"] for e in engines):
            ready.update(e["address"] for e in engines)
        return len(ready) >= count

    web.wait_for(
        probe,
        PLUGIN_READY_S,
        f"{count} API servers' plugins ready",
        interval_s=0.2,
        abort=lambda: first_exited(server),
    )
    return ready


def server_of(doc: dict[str, Any]) -> str:
    """Which API server answered a ``/dp/status`` (every engine's ``address`` names it:
    ``in-process (vLLM client <index>)``)."""
    return str(doc["engines"][0]["address"])


#: A test on one ``/dp/status`` document.
Accept = Callable[[dict[str, Any]], bool]


def every_api_server(
    endpoint: Endpoint,
    count: int,
    accept: Accept,
    what: str,
    timeout_s: float,
    abort: Callable[[], str | None] | None = None,
) -> dict[str, dict[str, Any]]:
    """API server → its first ``/dp/status`` that ``accept`` takes, once ``count`` servers
    answered one. A request reaches whichever server accepts it first and each polls for
    itself: one server's answer says nothing of the other's (a state seen in one can come a
    poll later in the other)."""
    seen: dict[str, dict[str, Any]] = {}
    last: dict[str, str] = {}  # per server: its last read, for the failure's message

    def probe() -> dict[str, dict[str, Any]] | None:
        doc = endpoint.status()
        last[server_of(doc)] = brief(doc)
        if server_of(doc) not in seen and accept(doc):
            seen[server_of(doc)] = doc
        return seen if len(seen) >= count else None

    try:
        return web.wait_for(
            probe, timeout_s, f"{what} from {count} API servers", interval_s=0.1, abort=abort
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}; accepted from {sorted(seen)}; last reads: {last}") from exc


def brief(doc: dict[str, Any]) -> str:
    """One ``/dp/status`` in a line: its poll, where it came from, each rank's state and
    reasons (``poll 31 follower/api_server_0 0=awake 1=hung(hung: no answer for 12 s)``)."""
    poll = doc.get("last_poll") or {}
    source = poll.get("source") or {}
    ranks = " ".join(
        f"{e['engine']}={e['state']}"
        + (f"({'; '.join(e['routable']['reasons'])})" if e["routable"]["reasons"] else "")
        for e in doc["engines"]
    )
    return f"poll {poll.get('number')} {source.get('role')}/{source.get('from')} {ranks}"


def start_unlisted_server(
    runtime: VllmRuntime, procs: ProcessGroup, token_file: Path, token: str
) -> PluginServer:
    """A single-engine ``vllm serve`` with the package installed and configured
    (``VLLM_DP_EXPORTER_*``) but ``VLLM_PLUGINS`` unset: vLLM must not load the plugin."""
    port = free_port()
    api_url = f"http://{HOST}:{port}"
    env = vllm_env(runtime, None, {"POLL_INTERVAL": "1", "ADMIN_TOKEN_FILE": str(token_file)})
    server = procs.start("vllm-serve-unlisted", runtime.api_server(port), env, cwd=procs.log_dir)
    wait_api_ready(api_url, server)
    return PluginServer(server, api_url, Endpoint(api_url, api_url, "/dp", token))


@dataclass
class Trainer:
    """The trainer's process (``embedded_trainer.py``) and its exporter's listeners."""

    proc: Managed
    endpoint: Endpoint
    ready: dict[str, Any]

    def events(self) -> list[dict[str, Any]]:
        """The JSON lines the script printed (vLLM's own log lines are not JSON)."""
        found = []
        for line in self.proc.log_text().splitlines():
            if line.startswith('{"event"'):
                found.append(json.loads(line))
        return found

    def terminate(self, timeout_s: float) -> int | None:
        """SIGTERM to the trainer alone (as a supervisor sends it; the engines are its
        children and its to stop), then its exit code within ``timeout_s`` (None: still up)."""
        self.proc.popen.send_signal(signal.SIGTERM)
        try:
            return self.proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None


def ready_event(proc: Managed) -> dict[str, Any] | None:
    for line in proc.log_text().splitlines():
        if line.startswith('{"event": "ready"'):
            event: dict[str, Any] = json.loads(line)
            return event
    return None


def start_trainer(
    runtime: VllmRuntime, procs: ProcessGroup, token_file: Path, token: str
) -> Trainer:
    """``embedded_trainer.py`` under vLLM's Python (``-P``: the script's folder, ``e2e/``, is
    not put on ``sys.path``), ready once it printed its ``ready`` line."""
    argv = [
        str(runtime.venv / "bin" / "python"), "-P", str(TRAINER_SCRIPT), str(runtime.model),
        "--token-file", str(token_file),
        "--listen", f"{HOST}:0", "--admin-listen", f"{HOST}:0",
        "--data-parallel-size", "2",
    ]  # fmt: skip
    proc = procs.start("embedded-trainer", argv, vllm_env(runtime, None), cwd=procs.log_dir)
    ready = web.wait_for(
        lambda: ready_event(proc),
        READY_TIMEOUT_S,
        "the trainer's ready line",
        interval_s=1.0,
        abort=lambda: first_exited(proc),
    )
    endpoint = Endpoint(str(ready["url"]), str(ready["admin_url"]), "", token)
    web.wait_for(
        lambda: web.answers(f"{endpoint.url}/readyz") == 200,
        PLUGIN_READY_S,
        f"{endpoint.url}/readyz",
        abort=lambda: first_exited(proc),
    )
    return Trainer(proc, endpoint, ready)


def group_alive(pgid: int) -> bool:
    """Whether any process is left in the process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
