"""Packaging: pyproject metadata, LICENSE, the Dockerfile (parsed, Docker is not needed), the
root .dockerignore and the image's HEALTHCHECK script (run against a real HTTP server)."""

from __future__ import annotations

import fnmatch
import hashlib
import http.server
import json
import re
import shlex
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.harness import artefacts

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = artefacts.ROOT
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
#: md5 of https://www.apache.org/licenses/LICENSE-2.0.txt
APACHE_2_MD5 = "3b83ef96387f14655fc854ddc3c6bd57"
OCI_LABELS = {
    "org.opencontainers.image.title",
    "org.opencontainers.image.description",
    "org.opencontainers.image.version",
    "org.opencontainers.image.revision",
    "org.opencontainers.image.licenses",
    "org.opencontainers.image.source",
}


def _pyproject() -> dict[str, Any]:
    data: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return data


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions():
        if keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((keyword, args))
    return stages


def test_license_is_spdx_with_the_apache_text():
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not a TOML table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.md5(text).hexdigest() == APACHE_2_MD5
    assert not [c for c in project["classifiers"] if c.startswith("License ::")], (
        "PEP 639: no License classifier beside a license expression"
    )
    requires = _pyproject()["build-system"]["requires"]
    (setuptools,) = [r for r in requires if r.startswith("setuptools")]
    assert re.fullmatch(r"setuptools>=(\d+)", setuptools) and int(setuptools[12:]) >= 77


def test_classifiers_urls_and_bounded_dependencies():
    project = _pyproject()["project"]
    classifiers = project["classifiers"]
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    low = tuple(int(x) for x in project["requires-python"].removeprefix(">=").split("."))
    for c in classifiers:
        m = re.fullmatch(r"Programming Language :: Python :: 3\.(\d+)", c)
        if m:
            assert (3, int(m.group(1))) >= low, c
    assert {"Homepage", "Source", "Issues", "Documentation"} <= set(project["urls"])
    for dep in project["dependencies"]:
        assert re.search(r">=[^,]+,<\d", dep), f"{dep}: needs a lower and an upper bound"


def test_dockerfile_is_multi_stage_without_source_in_the_final_image():
    stages = _stages()
    assert len(stages) >= 2
    build, final = stages[0], stages[-1]
    assert build[0][1].endswith(" AS build")
    assert any(k == "RUN" and "pip install ." in a for k, a in build)
    copies = [a for k, a in final if k in ("COPY", "ADD")]
    assert any(a.startswith("--from=build ") for a in copies)
    for args in copies:
        if args.startswith("--from="):
            continue
        sources = shlex.split(args)[:-1]
        # only the healthcheck script and the licence come from the build context
        assert sources and all(s in ("deploy/docker/healthcheck.py", "LICENSE") for s in sources), (
            f"final stage copies {sources} from the build context"
        )
    assert not any(k == "RUN" and "pip install" in a for k, a in final)


def test_dockerfile_oci_labels_and_healthcheck():
    final = _stages()[-1]
    labels: dict[str, str] = {}
    for keyword, args in final:
        if keyword == "LABEL":
            for item in shlex.split(args):
                key, _, value = item.partition("=")
                labels[key] = value
    assert set(labels) >= OCI_LABELS, OCI_LABELS - set(labels)
    assert labels["org.opencontainers.image.licenses"] == _pyproject()["project"]["license"]
    assert labels["org.opencontainers.image.source"] == _pyproject()["project"]["urls"]["Source"]
    (health,) = [a for k, a in final if k == "HEALTHCHECK"]
    cmd = json.loads(health[health.index("CMD ") + 4 :])
    assert cmd[0] == "python" and cmd[1].endswith("/healthcheck.py")
    assert any(
        k == "COPY" and a.split()[0] == "deploy/docker/healthcheck.py" and a.split()[-1] == cmd[1]
        for k, a in final
    )
    assert "19400" not in health, "the healthcheck must follow the configured port"


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore semantics for the patterns used here (last match wins)."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pat.startswith("**/"):
            hit = any(fnmatch.fnmatch(p, pat[3:]) for p in parts)
        else:
            hit = any(fnmatch.fnmatch(p, pat) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_root_dockerignore_sends_only_what_the_build_needs():
    assert not (ROOT / "deploy" / "docker" / "Dockerfile.dockerignore").exists(), (
        "BuildKit prefers <Dockerfile>.dockerignore over the root file"
    )
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    needed = ["pyproject.toml", "README.md", "LICENSE", "deploy/docker/healthcheck.py"]
    needed += [str(p.relative_to(ROOT)) for p in (ROOT / "exporter").rglob("*.py")]
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is excluded from the build context"
    for path in (
        ".git/config",
        ".venv/bin/python",
        "tests/conftest.py",
        "e2e/x.py",
        "docs/a.md",
        "exporter/__pycache__/a.pyc",
        "grafana/dashboards/vllm-dp-exporter.json",
    ):
        assert _ignored(path, patterns), f"{path} is sent to the Docker daemon"  # fmt: skip
    # every COPY source of the Dockerfile is in the context
    for keyword, args in _instructions():
        if keyword == "COPY" and not args.startswith("--from="):
            for source in shlex.split(args)[:-1]:
                assert (ROOT / source).exists() and not _ignored(source.rstrip("/"), patterns)


def _healthcheck_module() -> ModuleType:
    return artefacts.load_script(HEALTHCHECK, "vllm_dp_healthcheck")


def test_healthcheck_follows_the_configured_port():
    hc = _healthcheck_module()
    argv = ["/opt/vllm-dp-exporter/bin/python", "/opt/vllm-dp-exporter/bin/vllm-dp-exporter"]
    assert hc.listen_address([*argv, "serve"], {}) == "0.0.0.0:19400"
    assert hc.listen_address([*argv, "serve"], {"VLLM_DP_EXPORTER_LISTEN": "0.0.0.0:9"}) == (
        "0.0.0.0:9"
    )
    env = {"VLLM_DP_EXPORTER_LISTEN": "0.0.0.0:9"}
    assert hc.listen_address([*argv, "demo", "--listen", "0.0.0.0:8"], env) == "0.0.0.0:8"
    assert hc.listen_address([*argv, "serve", "--listen=10.1.2.3:7"], env) == "10.1.2.3:7"
    assert hc.healthz_url("0.0.0.0:19400") == "http://127.0.0.1:19400/healthz"
    assert hc.healthz_url("[::]:19400") == "http://[::1]:19400/healthz"
    assert hc.healthz_url("10.1.2.3:7") == "http://10.1.2.3:7/healthz"
    with pytest.raises(ValueError):
        hc.healthz_url("0.0.0.0:x")


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_healthcheck_script_against_a_real_listener(monkeypatch):
    hc = _healthcheck_module()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        monkeypatch.setattr(hc, "pid1_argv", lambda: ["x", "serve", "--listen", f"0.0.0.0:{port}"])
        assert hc.main() == 0
        monkeypatch.setattr(hc, "pid1_argv", lambda: [])
        monkeypatch.setenv("VLLM_DP_EXPORTER_LISTEN", f"127.0.0.1:{port}")
        assert hc.main() == 0
    finally:
        server.shutdown()
        server.server_close()
    # nothing listens there any more: unhealthy, exit 1
    assert hc.main() == 1
    assert Path(sys.executable).exists()
