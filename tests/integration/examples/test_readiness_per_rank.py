"""``deploy/kubernetes/leaderworkerset/readiness-per-rank.yaml``: the patch builds onto the
LeaderWorkerSet recipe with kubectl kustomize (only the worker pods' ``vllm`` container gets
the probe; the leader, the front end's pod, is untouched), the patched template validates
against the Kubernetes schemas, and the probe's own script, run against a real exporter over
simulated engines, passes while its pod's ranks are routable and fails, naming the rank, while
one is paused or unknown."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import artefacts
from tests.harness.service import ServiceFactory

RECIPE = artefacts.ROOT / "deploy" / "kubernetes" / "leaderworkerset"
PATCH = RECIPE / "readiness-per-rank.yaml"
KUBERNETES_VERSIONS = ("1.29.0", "latest")


def build(folder: Path) -> dict[str, Any]:
    """The recipe with the patch, as its README comment says to add it; the LeaderWorkerSet."""
    (folder / PATCH.name).write_text(PATCH.read_text())
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(RECIPE, folder)],  # kustomize takes no absolute root
        "patches": [{"path": PATCH.name, "target": {"kind": "LeaderWorkerSet", "name": "vllm-dp"}}],
    }
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    kubectl = artefacts.tool("kubectl")
    proc = subprocess.run(
        [kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    (lws,) = [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "LeaderWorkerSet"]
    return dict(lws)


def container(template: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in template["spec"]["containers"] if c["name"] == name]
    return dict(found)


def probe_script(lws: dict[str, Any]) -> str:
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    command = container(worker, "vllm")["readinessProbe"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    return str(command[2])


def test_the_patch_gives_the_workers_engines_a_per_rank_probe(tmp_path: Path) -> None:
    lws = build(tmp_path)
    lwt = lws["spec"]["leaderWorkerTemplate"]
    probe = container(lwt["workerTemplate"], "vllm")["readinessProbe"]
    assert probe["periodSeconds"] == 5 and probe["failureThreshold"] == 2
    assert "livenessProbe" not in container(lwt["workerTemplate"], "vllm")
    assert "readinessProbe" not in container(lwt["leaderTemplate"], "vllm"), "leader untouched"
    script = probe_script(lws)
    assert "/readyz?engine={rank}" in script and "LWS_WORKER_INDEX" in script
    compile(script, "probe", "exec")
    kv = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    template = lwt["workerTemplate"]
    for version in KUBERNETES_VERSIONS:
        version = utils.latest_version() if version == "latest" else version
        pod = {"apiVersion": "v1", "kind": "Pod", **template}
        pod["metadata"] = {"name": "worker", **template.get("metadata", {})}
        try:
            kv.validate(pod, version, strict=True)
        except utils.ValidationError as exc:
            pytest.fail(f"{'.'.join(map(str, exc.path))}: {exc.message}")


async def run_probe(script: str, worker_index: int) -> tuple[int, str]:
    env = {"ENGINES_PER_POD": "2", "LWS_WORKER_INDEX": str(worker_index), "PATH": os.defpath}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, env=env, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_the_probe_follows_its_pods_ranks(
    tmp_path: Path, fleet_factory: ServiceFactory
) -> None:
    fleet = await fleet_factory(4, gate_min_interval=0.0)
    script = probe_script(build(tmp_path)).replace("http://127.0.0.1:19400", fleet.url)
    assert fleet.url in script
    assert await run_probe(script, 0) == (0, "")
    assert await run_probe(script, 1) == (0, "")
    fleet.engines[3].state.paused = True
    await fleet.fresh_poll()
    code, out = await run_probe(script, 1)
    assert code == 1 and out.startswith("rank 3: HTTP Error 503"), out
    assert await run_probe(script, 0) == (0, ""), "the other pod's ranks are fine"
    code, out = await run_probe(script, 2)  # ranks 4 and 5: no such engine
    assert code == 1 and out.startswith("rank 4: HTTP Error 404"), out
