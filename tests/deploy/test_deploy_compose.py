"""docker compose playground and Dockerfile (Docker itself is not needed for these checks)."""

from __future__ import annotations

import json
import shutil

import yaml


def _compose(deploy) -> dict:
    return yaml.safe_load(deploy.COMPOSE_FILE.read_text(encoding="utf-8"))


def test_compose_services(deploy):
    services = _compose(deploy)["services"]
    assert set(services) == {"exporter", "prometheus", "grafana"}
    exporter = services["exporter"]
    assert exporter["command"] == ["demo", "--engines", "4", "--listen", "0.0.0.0:9400"]
    context = (deploy.COMPOSE_FILE.parent / exporter["build"]["context"]).resolve()
    assert context == deploy.ROOT
    assert (context / exporter["build"]["dockerfile"]).is_file()
    assert "9400:9400" in exporter["ports"]


def test_compose_bind_mounts_exist(deploy):
    for name, service in _compose(deploy)["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (deploy.COMPOSE_FILE.parent / source).exists(), f"{name}: {source}"


def test_compose_prometheus_config(deploy, tmp_path):
    """promtool checks the compose Prometheus config with the rules mounted beside it."""
    promtool = deploy.tool("promtool")
    compose_dir = deploy.COMPOSE_FILE.parent
    config = yaml.safe_load((compose_dir / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    assert "vllm-dp-exporter" in job["job_name"]  # VllmDpExporterDown matches on it
    assert job["static_configs"][0]["targets"] == ["exporter:9400"]
    mounts = {
        v.split(":")[1]: v.split(":")[0]
        for v in _compose(deploy)["services"]["prometheus"]["volumes"]
    }
    for target, source in mounts.items():
        shutil.copy(compose_dir / source, tmp_path / target.rsplit("/", 1)[1])
    assert config["rule_files"] == ["vllm-dp-exporter.rules.yml"]
    deploy.run([promtool, "check", "config", str(tmp_path / "prometheus.yml")], timeout=60)


def test_dockerfile(deploy):
    text = (deploy.ROOT / "deploy" / "docker" / "Dockerfile").read_text(encoding="utf-8")
    lines = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert lines[0] == "FROM python:3.11-slim"
    assert any(line.startswith("RUN pip install .") for line in lines)
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "EXPOSE 9400" in lines
    (entrypoint,) = [line for line in lines if line.startswith("ENTRYPOINT ")]
    assert json.loads(entrypoint[len("ENTRYPOINT ") :]) == ["vllm-dp-exporter"]
