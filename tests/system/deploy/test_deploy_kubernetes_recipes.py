"""Deployment recipes beside the base: relay and HTTP overlays, the kube-prometheus-stack
component, the LeaderWorkerSet recipe. Built with kubectl kustomize, validated offline against
the Kubernetes schemas (LeaderWorkerSet's pod templates as Pods), and the exporter's arguments
parsed by the exporter's own CLI and configuration rules."""

from __future__ import annotations

import copy
import functools
import shlex
import subprocess
from typing import Any

import pytest
import yaml

from tests.harness import artefacts

K8S = artefacts.ROOT / "deploy" / "kubernetes"
RECIPES = {
    "relay": K8S / "overlays" / "relay",
    "http": K8S / "overlays" / "http",
    "leaderworkerset": K8S / "leaderworkerset",
}
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "LeaderWorkerSet"}
KUBERNETES_VERSIONS = ("1.29.0", "latest")


@functools.cache
def _build(path: str) -> tuple[dict[str, Any], ...]:
    kubectl = artefacts.tool("kubectl")
    proc = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def _resources(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_build(str(RECIPES[name]))))


def _pod_templates(resources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in resources:
        if r["kind"] == "Deployment":
            out.append(r["spec"]["template"])
        elif r["kind"] == "LeaderWorkerSet":
            lwt = r["spec"]["leaderWorkerTemplate"]
            out += [lwt["leaderTemplate"], lwt["workerTemplate"]]
    return out


def _exporter_argv(container: dict[str, Any]) -> list[str]:
    """The exporter's argv with $(VAR) / $VAR / $((...)) replaced by plausible values."""
    env = {e["name"]: e.get("value", "1") for e in container.get("env", [])}
    env.update({"WORKER_INDEX": "1", "GROUP_INDEX": "0"})
    if container.get("command") == ["sh", "-c"]:
        script = container["args"][0]
        script = script.replace("$((WORKER_INDEX * ENGINES_PER_POD))", "2")
        for key, value in env.items():
            script = script.replace(f'"${key}"', value).replace(f"${key}", value)
        argv = shlex.split(script)
        assert argv[:2] == ["exec", "vllm-dp-exporter"], argv
        argv = argv[2:]
    else:
        argv = list(container["args"])
    return [a.replace("$(MODEL)", env.get("MODEL", "")) for a in argv]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_validates_against_kubernetes_schemas(name):
    kv = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    resources = _resources(name)
    for version in KUBERNETES_VERSIONS:
        version = utils.latest_version() if version == "latest" else version
        for res in resources:
            try:
                kv.validate(res, version, strict=True)
            except utils.SchemaNotFoundError:
                assert res["kind"] in CUSTOM_KINDS, f"no schema for {res['kind']}"
            except utils.ValidationError as exc:
                pytest.fail(f"{name}: {res['kind']}/{res['metadata']['name']}: {exc.message}")
        for template in _pod_templates(resources):
            pod = {"apiVersion": "v1", "kind": "Pod", **template}
            pod["metadata"] = {"name": "template", **template.get("metadata", {})}
            try:
                kv.validate(pod, version, strict=True)
            except utils.ValidationError as exc:
                pytest.fail(f"{name}: pod template: {'.'.join(map(str, exc.path))}: {exc.message}")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_exporter_arguments_are_accepted_by_the_exporter(name, tmp_path):
    from exporter.commands.cli import build_parser
    from exporter.config.settings import resolve_config

    token = tmp_path / "admin-token"
    token.write_text("x" * 32)
    templates = [t for t in _pod_templates(_resources(name)) if t["spec"].get("initContainers")]
    assert templates
    for template in templates:
        (sidecar,) = [
            c for c in template["spec"]["initContainers"] if c["name"] == "vllm-dp-exporter"
        ]
        assert sidecar["restartPolicy"] == "Always"
        argv = _exporter_argv(sidecar)
        argv = [str(token) if a.endswith("/admin-token") else a for a in argv]
        args = build_parser().parse_args(argv)
        config = resolve_config(args, environ={})
        assert config.listen == "0.0.0.0:19400" and config.admin_listen == "127.0.0.1:19401"
        assert config.attach == ("http" if name == "http" else "relay")
        # --model-name is vLLM's served model name (the model argument), so vllm_dp_* joins vllm:*
        vllm = [c for c in template["spec"]["containers"] if c["name"] == "vllm"]
        models = {e["value"] for c in vllm for e in c["env"] if e["name"] == "MODEL"}
        assert models == {config.model_name}
        assert {"name": "metrics", "containerPort": 19400, "protocol": "TCP"} in sidecar["ports"]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_monitoring_objects_carry_the_kube_prometheus_stack_release_label(name):
    monitors = [r for r in _resources(name) if r["kind"] in ("PodMonitor", "PrometheusRule")]
    assert any(r["kind"] == "PodMonitor" for r in monitors)
    for r in monitors:
        assert r["metadata"]["labels"].get("release") == "kube-prometheus-stack", r["metadata"]


def test_relay_engines_dial_the_exporter_which_relays_to_the_front_end():
    resources = _resources("relay")
    (engines,) = [
        r for r in resources if r["kind"] == "Deployment" and r["metadata"]["name"] == "vllm-dp"
    ]
    (frontend,) = [
        r
        for r in resources
        if r["kind"] == "Deployment" and r["metadata"]["name"] == "vllm-dp-frontend"
    ]
    spec = engines["spec"]["template"]["spec"]
    ex = spec["initContainers"][0]["args"]
    vllm = spec["containers"][0]["args"]
    fe = frontend["spec"]["template"]["spec"]["containers"][0]["args"]
    hs = ex[ex.index("--handshake-address") + 1]
    assert (
        "--headless" in vllm
        and hs == f"tcp://127.0.0.1:{vllm[vllm.index('--data-parallel-rpc-port') + 1]}"
    )
    upstream = ex[ex.index("--upstream-handshake-address") + 1]
    svc = [
        r
        for r in resources
        if r["kind"] == "Service" and r["metadata"]["name"] == "vllm-dp-frontend"
    ]
    assert (
        upstream == f"tcp://vllm-dp-frontend:{fe[fe.index('--data-parallel-rpc-port') + 1]}" and svc
    )
    assert fe[fe.index("--data-parallel-size-local") + 1] == "0"
    assert fe[fe.index("--data-parallel-size") + 1] == vllm[vllm.index("--data-parallel-size") + 1]
    assert ex[ex.index("--engine-count") + 1] == vllm[vllm.index("--data-parallel-size-local") + 1]


def test_http_mode_api_server_has_dev_mode_and_is_the_target():
    (dep,) = [r for r in _resources("http") if r["kind"] == "Deployment"]
    spec = dep["spec"]["template"]["spec"]
    vllm = spec["containers"][0]
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in vllm["env"]
    assert "--headless" not in vllm["args"]
    port = vllm["args"][vllm["args"].index("--port") + 1]
    ex = spec["initContainers"][0]["args"]
    assert ex[ex.index("--http-target") + 1] == f"0=http://127.0.0.1:{port}"


def test_leaderworkerset_ranks_and_sizes_line_up():
    (lws,) = [r for r in _resources("leaderworkerset") if r["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    lwt = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]
    assert [c["name"] for c in leader["containers"]] == ["vllm", "frontend"]
    assert [c["name"] for c in worker["containers"]] == ["vllm"]
    for spec in (leader, worker):
        (eng,) = [c for c in spec["containers"] if c["name"] == "vllm"]
        per_pod = {e["name"]: e.get("value") for e in eng["env"]}["ENGINES_PER_POD"]
        assert str(eng["resources"]["limits"]["nvidia.com/gpu"]) == per_pod
        script = eng["args"][0]
        assert '--data-parallel-start-rank "$((LWS_WORKER_INDEX * ENGINES_PER_POD))"' in script
        assert "--data-parallel-rpc-port 29551" in script and "--headless" in script
        ex = spec["initContainers"][0]
        assert '--start-rank "$((WORKER_INDEX * ENGINES_PER_POD))"' in ex["args"][0]
        assert "--handshake-address tcp://127.0.0.1:29551" in ex["args"][0]
    (fe,) = [c for c in leader["containers"] if c["name"] == "frontend"]
    assert "--data-parallel-size-local 0" in fe["args"][0]
    assert "--data-parallel-rpc-port 29550" in fe["args"][0]
