"""docker compose playground and Dockerfile (Docker itself is not needed for these checks)."""

from __future__ import annotations

import json
import shutil
from typing import Any

import yaml

from tests.harness import artefacts


def _compose() -> Any:
    return yaml.safe_load(artefacts.COMPOSE_FILE.read_text(encoding="utf-8"))


def test_compose_services():
    services = _compose()["services"]
    assert set(services) == {"exporter", "prometheus", "grafana"}
    exporter = services["exporter"]
    assert exporter["command"] == ["demo", "--engines", "4", "--listen", "0.0.0.0:19400"]
    context = (artefacts.COMPOSE_FILE.parent / exporter["build"]["context"]).resolve()
    assert context == artefacts.ROOT
    assert (context / exporter["build"]["dockerfile"]).is_file()
    assert "19400:19400" in exporter["ports"]


def test_compose_bind_mounts_exist():
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (artefacts.COMPOSE_FILE.parent / source).exists(), f"{name}: {source}"


def test_compose_prometheus_config(tmp_path):
    """promtool checks the compose Prometheus config with the rules mounted beside it."""
    promtool = artefacts.tool("promtool")
    compose_dir = artefacts.COMPOSE_FILE.parent
    config = yaml.safe_load((compose_dir / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    assert "vllm-dp-exporter" in job["job_name"]  # VllmDpExporterDown matches on it
    assert job["static_configs"][0]["targets"] == ["exporter:19400"]
    mounts = {
        v.split(":")[1]: v.split(":")[0] for v in _compose()["services"]["prometheus"]["volumes"]
    }
    for target, source in mounts.items():
        shutil.copy(compose_dir / source, tmp_path / target.rsplit("/", 1)[1])
    assert config["rule_files"] == ["vllm-dp-exporter.rules.yml"]
    artefacts.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], timeout=60)


def test_dockerfile():
    """Basic shape; the multi-stage build, labels and healthcheck: test_deploy_packaging.py."""
    text = (artefacts.ROOT / "deploy" / "docker" / "Dockerfile").read_text(encoding="utf-8")
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "ARG PYTHON_IMAGE=python:3.11-slim"
    assert any("pip install ." in line for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "EXPOSE 19400" in lines
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert json.loads(entrypoint[len("ENTRYPOINT ") :]) == ["vllm-dp-exporter"]
