"""The platform of the vLLM 0.34 engine-code runs (``e2e/test_vllm034.py``): vLLM's own CPU
platform with two checks relaxed, chosen through vLLM's platform-plugin entry point.

Loaded by vLLM only: ``e2e/vllm034.py`` writes a dist-info into the engine folder declaring
``register_platform`` under ``vllm.platform_plugins`` (the group vLLM 0.34 scans in
``resolve_current_platform_cls_qualname``, ``vllm/platforms/__init__.py``), and runs every
0.34 process with ``VLLM_PLUGINS=dp_e2e_stub`` (no other plugin) and this folder on
``PYTHONPATH``. An activated out-of-tree platform plugin wins over the built-in CPU one. vLLM loads
this module while it is still resolving its platform: it imports only ``vllm.platforms.cpu``
(what vLLM itself imports next), never a module that reads ``current_platform`` (that would
recurse into the resolution).

Why not vLLM's ``CpuPlatform`` as it is (read in 0.34's ``vllm/platforms/cpu.py`` and
``vllm/platforms/interface.py``):

* **Triton CPU.** 0.34's ``CpuPlatform.check_and_update_config`` raises ``vLLM on x86 CPUs
  requires Triton (triton-cpu)`` unless ``vllm.triton_utils.HAS_TRITON``, which on a CPU build
  needs Triton's ``cpu`` backend (``triton-cpu``: not on PyPI; the CPU build of 0.34, which
  would bring it, does not exist). Only the model runner's kernels use it, and the stub
  executor (``dp_e2e_stub.py``) runs none, so ``StubCpuPlatform`` runs vLLM's check with
  ``HAS_TRITON`` reading true for that call alone, and every other line of it as it is.
* **Sleep mode** (``DP_E2E_SLEEP_MODE=1``): ``Platform.is_sleep_mode_available`` is false
  on CPU, so ``--enable-sleep-mode`` is refused ("Sleep mode is not supported on current
  platform") and the checkpoint lifecycle, which needs it (``checkpoint_prepare``: "Preparing
  for a checkpoint requires --enable-sleep-mode"), could not run. ``SleepCapableCpuPlatform``
  says it is available; the stub worker then answers ``sleep``, ``wake_up``, ``discard`` and
  ``checkpoint_*`` as a worker that did them.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.platforms.cpu import CpuPlatform  # type: ignore[import-not-found]

SLEEP_MODE_ENV = "DP_E2E_SLEEP_MODE"


class StubCpuPlatform(CpuPlatform):  # type: ignore[misc]
    """vLLM's CPU platform; its config check runs as if Triton CPU were installed."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        import vllm.triton_utils as triton_utils  # type: ignore[import-not-found]

        saved = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            super().check_and_update_config(vllm_config)
        finally:
            triton_utils.HAS_TRITON = saved


class SleepCapableCpuPlatform(StubCpuPlatform):
    """The same, and ``--enable-sleep-mode`` is accepted."""

    def is_sleep_mode_available(self) -> bool:
        return True


def register_platform() -> str:
    """The ``vllm.platform_plugins`` entry point: the qualified name of the platform class."""
    cls = SleepCapableCpuPlatform if os.environ.get(SLEEP_MODE_ENV) == "1" else StubCpuPlatform
    return f"{__name__}.{cls.__name__}"
