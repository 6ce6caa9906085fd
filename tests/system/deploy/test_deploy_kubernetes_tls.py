"""The TLS variant of the Kubernetes recipe (components/tls, built by overlays/tls): validated
offline against the Kubernetes schemas, the exporter's arguments accepted by the exporter, the
web config example loaded by the exporter with certificates beside it, and the PodMonitor
scraping over HTTPS with basic auth."""

from __future__ import annotations

import base64
import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.commands.cli import build_parser
from exporter.config.settings import resolve_config
from exporter.config.webconfig import load_web_config
from exporter.web.basicauth import BasicAuthChecker
from tests.harness import artefacts
from tests.harness.tls import make_pki

K8S = artefacts.ROOT / "deploy" / "kubernetes"
OVERLAY = K8S / "overlays" / "tls"
EXAMPLE = K8S / "components" / "tls" / "web-config.example.yml"
KUBERNETES_VERSIONS = ("1.29.0", "latest")


@functools.cache
def _build() -> tuple[dict[str, Any], ...]:
    kubectl = artefacts.tool("kubectl")
    proc = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return tuple(doc for doc in yaml.safe_load_all(proc.stdout) if doc)


def _one(kind: str) -> dict[str, Any]:
    (found,) = [r for r in _build() if r["kind"] == kind]
    return found


def _sidecar() -> dict[str, Any]:
    spec = _one("Deployment")["spec"]["template"]["spec"]
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "vllm-dp-exporter"]
    return dict(sidecar)


def test_tls_overlay_validates_against_kubernetes_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate import utils

    for version in KUBERNETES_VERSIONS:
        version = utils.latest_version() if version == "latest" else version
        for res in _build():
            try:
                kv.validate(res, version, strict=True)
            except utils.SchemaNotFoundError:
                assert res["kind"] in {"PodMonitor", "PrometheusRule"}, res["kind"]
            except utils.ValidationError as exc:
                pytest.fail(f"{res['kind']}/{res['metadata']['name']}: {exc.message}")


def test_exporter_reads_the_mounted_web_config_and_probes_use_https(tmp_path: Path) -> None:
    sidecar = _sidecar()
    argv = sidecar["args"]
    path = argv[argv.index("--web-config-file") + 1]
    (mount,) = [m for m in sidecar["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    volumes = {v["name"]: v for v in _one("Deployment")["spec"]["template"]["spec"]["volumes"]}
    sources = volumes[mount["name"]]["projected"]["sources"]
    files = {item["path"] for s in sources for item in s["secret"]["items"]}
    assert files == {"tls.crt", "tls.key", Path(path).name}
    # The example web config, with test certificates beside it as the projected volume puts
    # them, loads; its relative paths resolve against its own directory.
    pki = make_pki(tmp_path / "pki")
    web_dir = tmp_path / "web"
    web_dir.mkdir()
    shutil.copy(pki.server_cert, web_dir / "tls.crt")
    shutil.copy(pki.server_key, web_dir / "tls.key")
    shutil.copy(EXAMPLE, web_dir / Path(path).name)
    token = tmp_path / "admin-token"
    token.write_text("x" * 32)
    argv = [
        str(token)
        if a.endswith("/admin-token")
        else str(web_dir / Path(path).name)
        if a == path
        else a
        for a in argv
    ]
    config = resolve_config(build_parser().parse_args(argv), environ={}, model_name="m")
    assert config.web is not None and config.web.ssl_context is not None
    assert list(config.web.users) == [b"prometheus"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["httpGet"] == {
            "path": "/healthz",
            "port": "metrics",
            "scheme": "HTTPS",
        }


def test_podmonitor_scrapes_over_https_with_basic_auth() -> None:
    (endpoint,) = _one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["scheme"] == "https"
    tls = endpoint["tlsConfig"]
    assert tls["serverName"] == "vllm-dp-exporter"
    assert tls["ca"] == {"secret": {"name": "vllm-dp-exporter-tls", "key": "ca.crt"}}
    assert "insecureSkipVerify" not in tls
    auth = endpoint["basicAuth"]
    assert auth["username"]["name"] == auth["password"]["name"] == "vllm-dp-exporter-scrape-auth"
    # The base stays plain HTTP.
    base = artefacts.run([artefacts.tool("kubectl"), "kustomize", str(K8S / "base")]).stdout
    (plain,) = [d for d in yaml.safe_load_all(base) if d and d["kind"] == "PodMonitor"]
    assert "scheme" not in plain["spec"]["podMetricsEndpoints"][0]


async def test_web_config_example_is_valid_exporter_toolkit_format(tmp_path: Path) -> None:
    """Only keys exporter-toolkit knows; loads once its certificate files exist; its hash is
    the documented placeholder password's."""
    data = yaml.safe_load(EXAMPLE.read_text())
    assert set(data) <= {"tls_server_config", "http_server_config", "basic_auth_users"}
    pki = make_pki(tmp_path)
    shutil.copy(pki.server_cert, tmp_path / "tls.crt")
    shutil.copy(pki.server_key, tmp_path / "tls.key")
    shutil.copy(EXAMPLE, tmp_path / "web.yml")
    config = load_web_config(str(tmp_path / "web.yml"))
    assert config.client_auth_type == "NoClientCert"
    header = "Basic " + base64.b64encode(b"prometheus:change-me").decode()
    assert await BasicAuthChecker(config.users).check(header)
