"""Kustomize base: builds, validates offline against Kubernetes schemas, wires the sidecar right."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import yaml

from tests.harness import artefacts

# Native sidecars (initContainers[].restartPolicy: Always) are on by default from 1.29.
KUBERNETES_VERSIONS = ("1.29.0", "latest")
CUSTOM_KINDS = {
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
}
TOKEN_FILE = "/var/run/secrets/vllm-dp-exporter/admin-token"


@functools.lru_cache(maxsize=1)
def _build(kubectl: str, path: str) -> tuple[Any, ...]:
    import subprocess

    proc = subprocess.run([kubectl, "kustomize", path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize failed:\n{proc.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


@pytest.fixture()
def resources() -> list[dict[str, Any]]:
    kubectl = artefacts.tool("kubectl")
    return copy.deepcopy(list(_build(kubectl, str(artefacts.KUSTOMIZE_DIR))))


def _one(resources, kind: str) -> Any:
    (res,) = [r for r in resources if r["kind"] == kind]
    return res


def _arg(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def _pod(resources) -> Any:
    return _one(resources, "Deployment")["spec"]["template"]


def _sidecar(resources) -> Any:
    (c,) = [c for c in _pod(resources)["spec"]["initContainers"] if c["name"] == "vllm-dp-exporter"]
    return c


def _vllm(resources) -> Any:
    (c,) = [c for c in _pod(resources)["spec"]["containers"] if c["name"] == "vllm"]
    return c


def test_kustomize_builds_expected_kinds(resources):
    assert sorted(r["kind"] for r in resources) == [
        "Deployment",
        "PodMonitor",
        "PrometheusRule",
        "Service",
    ]


def test_validates_against_kubernetes_schemas(resources):
    kv = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (pip install kubernetes-validate)",
    )
    from kubernetes_validate import utils

    for version in KUBERNETES_VERSIONS:
        version = utils.latest_version() if version == "latest" else version
        for res in resources:
            key = (res["apiVersion"], res["kind"])
            try:
                kv.validate(res, version, strict=True)
            except utils.SchemaNotFoundError:
                # kubernetes-validate ships core schemas only; custom resources are checked
                # structurally by the tests below.
                assert key in CUSTOM_KINDS, f"no schema for {key}"
            except utils.ValidationError as exc:
                pytest.fail(
                    f"{res['kind']}/{res['metadata']['name']} invalid for Kubernetes "
                    f"{version}: {'.'.join(map(str, exc.path))}: {exc.message}"
                )

    # the validator really checks: a misspelt field must fail strict validation
    broken = copy.deepcopy(_one(resources, "Deployment"))
    broken["spec"]["template"]["spec"]["initContainers"][0]["restartPolcy"] = "Always"
    with pytest.raises(utils.ValidationError):
        kv.validate(broken, utils.latest_version(), strict=True)


def test_exporter_is_a_native_sidecar_with_the_contract_flags(resources):
    c = _sidecar(resources)
    assert c["restartPolicy"] == "Always"
    args = c["args"]
    assert args[0] == "serve"
    assert _arg(args, "--handshake-address") == "tcp://127.0.0.1:29550"
    assert _arg(args, "--advertise-host") == "127.0.0.1"
    assert _arg(args, "--listen") == "0.0.0.0:19400"
    assert _arg(args, "--admin-listen") == "127.0.0.1:19401"
    assert _arg(args, "--admin-token-file") == TOKEN_FILE
    assert {"name": "metrics", "containerPort": 19400, "protocol": "TCP"} in c["ports"]


def test_engine_count_matches_vllm_data_parallel_size(resources):
    engines = _arg(_sidecar(resources)["args"], "--engine-count")
    vllm = _vllm(resources)
    args = vllm["args"]
    assert vllm["command"] == ["vllm"] and args[0] == "serve"
    assert "--headless" in args and "--enable-sleep-mode" in args
    assert _arg(args, "--data-parallel-address") == "127.0.0.1"
    assert _arg(args, "--data-parallel-rpc-port") == "29550"
    assert _arg(args, "--data-parallel-size") == engines
    assert _arg(args, "--data-parallel-size-local") == engines
    assert str(vllm["resources"]["limits"]["nvidia.com/gpu"]) == engines


def test_sidecar_security_context_is_restricted(resources):
    sc = _sidecar(resources)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0


def test_probes_do_not_couple_pod_readiness_to_engines(resources):
    c = _sidecar(resources)
    live = c["livenessProbe"]["httpGet"]
    assert live["path"] == "/healthz" and live["port"] in (19400, "metrics")
    ready = c.get("readinessProbe")
    if ready is not None:
        assert ready["httpGet"]["path"] != "/readyz", "/readyz would unready the vLLM pod"


def test_admin_token_comes_from_a_secret_volume(resources):
    pod = _pod(resources)["spec"]
    (mount,) = [
        m
        for m in _sidecar(resources)["volumeMounts"]
        if TOKEN_FILE.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"]
    items = volume["secret"].get("items")
    if items is not None:
        assert TOKEN_FILE.rsplit("/", 1)[1] in [item["path"] for item in items]


def test_service_and_podmonitor_select_the_pod(resources):
    labels = _pod(resources)["metadata"]["labels"]
    svc = _one(resources, "Service")
    port = svc["spec"]["ports"][0]
    assert (port["name"], port["port"]) == ("metrics", 19400)
    assert svc["spec"]["selector"].items() <= labels.items()
    pm = _one(resources, "PodMonitor")
    assert pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_built_prometheusrule_equals_rules_file(resources):
    rule = _one(resources, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["spec"]["groups"] == artefacts.load_rules()["groups"]
