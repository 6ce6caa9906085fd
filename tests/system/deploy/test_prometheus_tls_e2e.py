"""End to end: a real Prometheus scrapes a real ``serve`` (with simulated engines) over TLS with
a client certificate and basic auth (``--web-config-file``), and gets data; a job without the
credentials is refused (401) and one without the client certificate fails its handshake.

Reuses ``test_prometheus_e2e``'s helpers; certificates are made at test time with openssl."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from tests.harness.artefacts import ROOT, tool
from tests.harness.prometheus import (
    http_json,
    instant_query,
    start_prometheus,
    stop,
    wait_for,
)
from tests.harness.tls import PASSWORD, USER, Pki, make_pki, write_web_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    prometheus = tool("prometheus")
    tmp = tmp_path_factory.mktemp("prom-tls")
    pki: Pki = make_pki(tmp / "pki")
    web = write_web_config(
        pki.dir / "web.yml",
        pki,
        client_auth_type="RequireAndVerifyClientCert",
        users={USER: PASSWORD},
    )
    port, admin, prom_port = free_listen_port(), free_listen_port(), free_listen_port()
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    env_cmd = [sys.executable, "-m", "exporter", "--log-level", "warning"]
    serve = subprocess.Popen(
        [
            *env_cmd,
            "serve",
            "--engine-count",
            "2",
            "--handshake-address",
            handshake,
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{admin}",
            "--poll-interval",
            "0.5",
            "--web-config-file",
            str(web),
        ],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    engines = subprocess.Popen(
        [*env_cmd, "sim-engine", "--handshake-address", handshake, "--engine-count", "2"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (tmp / "password").write_text(PASSWORD)
    tls = (
        f"    scheme: https\n    tls_config:\n      ca_file: {pki.ca_cert}\n"
        f"      server_name: localhost\n"
    )
    client_cert = f"      cert_file: {pki.client_cert}\n      key_file: {pki.client_key}\n"
    auth = f"    basic_auth:\n      username: {USER}\n      password_file: {tmp / 'password'}\n"
    target = f"    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    (tmp / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 500ms\n  evaluation_interval: 500ms\n"
        "scrape_configs:\n"
        f"  - job_name: vllm-dp-exporter-tls\n{tls}{client_cert}{auth}{target}"
        f"  - job_name: no-basic-auth\n{tls}{client_cert}{target}"
        f"  - job_name: no-client-cert\n{tls}{auth}{target}"
    )
    prom = start_prometheus(prometheus, tmp, prom_port)
    try:
        yield {"prometheus": f"http://127.0.0.1:{prom_port}"}
    finally:
        stop(prom)
        stop(engines)
        stop(serve)


def query(stack: dict[str, str], expr: str) -> list[Any]:
    return instant_query(stack["prometheus"], expr)


def targets(stack: dict[str, str]) -> dict[str, dict[str, Any]]:
    active = http_json(f"{stack['prometheus']}/api/v1/targets")["data"]["activeTargets"]
    return {t["labels"]["job"]: t for t in active}


def test_prometheus_scrapes_over_tls_with_basic_auth(tls_stack: dict[str, str]) -> None:
    wait_for(
        lambda: len(query(tls_stack, 'vllm_dp_engine_up{job="vllm-dp-exporter-tls"} == 1')) == 2,
        40,
        "2 engines up, scraped over TLS",
    )
    assert query(tls_stack, 'up{job="vllm-dp-exporter-tls"} == 1')
    assert targets(tls_stack)["vllm-dp-exporter-tls"]["scrapeUrl"].startswith("https://")


def test_prometheus_without_credentials_is_refused(tls_stack: dict[str, str]) -> None:
    def refused() -> dict[str, str] | None:
        found = targets(tls_stack)
        errors = {
            job: found.get(job, {}).get("lastError", "")
            for job in ("no-basic-auth", "no-client-cert")
        }
        return errors if all(errors.values()) else None

    errors = wait_for(refused, 30, "both refused jobs to report their error")
    assert "401" in errors["no-basic-auth"], errors
    assert "401" not in errors["no-client-cert"], errors  # refused in the TLS handshake
    assert query(tls_stack, 'up{job="no-basic-auth"} == 0')
    assert query(tls_stack, 'up{job="no-client-cert"} == 0')
    assert not query(tls_stack, 'vllm_dp_engine_up{job=~"no-.*"}')
