"""Test-only hook for ``e2e/test_progress.py``: make one real DP rank **hold its requests
without stepping** while its busy loop still answers utility calls (docs/e2e.md, scenario 14).

Never part of the exporter, never installed into vLLM's environment, and inert unless
``VLLM_DP_E2E_HOLD_DIR`` is set: the test puts this folder (``e2e/engine_hook/``, nothing else
in it) on ``PYTHONPATH`` of the ``vllm serve`` it starts, with ``VLLM_DP_E2E_HOLD_DIR`` naming a
temporary folder. Python imports ``sitecustomize`` at start-up in every process of that
deployment (vLLM's venv has none of its own to shadow; one found later on ``sys.path`` is still
imported, below).

How it reaches the engine (read from vLLM 0.32.0's installed source):

* **Spawned, not forked.** vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``
  (``vllm/platforms/cpu.py``, ``check_and_update_config``), and ``CoreEngineProcManager``
  starts each ``EngineCore_DP<rank>`` with that context (``vllm/v1/engine/utils.py``): a new
  interpreter that inherits the environment, so it runs this module before it unpickles its
  target ``EngineCoreProc.run_engine_core`` and imports ``vllm.v1.engine.core``. (Under fork
  the parent would have run it and imported the module first; the patched class is inherited
  either way.)
* **An import hook.** A meta-path finder lets the normal finders locate
  ``vllm.v1.engine.core`` and wraps its loader, so that right after the module executes,
  ``EngineCore.step`` and ``EngineCore.step_with_batch_queue`` are replaced by wrappers. No
  other module is touched; every other import only pays one string comparison.
* **Bound at construction.** ``EngineCore.__init__`` binds ``self.step_fn = self.step`` (or
  ``self.step_with_batch_queue`` when ``max_concurrent_batches`` > 1: pipeline parallelism
  or async scheduling, which the CPU platform turns off). The class is patched before any
  engine is built, so the bound method is the wrapper. ``EngineCoreProc`` and
  ``DPEngineCoreProc`` do not override either method.
* **The no-op step.** While ``<VLLM_DP_E2E_HOLD_DIR>/hold-rank-<rank>`` exists (``rank``: the
  engine's ``engine_index``, its DP rank), the wrapper returns what vLLM's own ``step``
  returns when it has nothing to schedule, ``({}, False)`` (``step_with_batch_queue``:
  ``(None, False)``), without calling ``scheduler.schedule``: running requests stay running
  with their KV blocks, new ones stay waiting, no token is computed, and no step outputs (so
  no stats) reach the front end. It sleeps ``HOLD_SLEEP_S`` first, so the loop does not spin.
* **It still answers.** ``EngineCoreProc.run_busy_loop`` runs ``_process_input_queue`` (which
  drains every queued client request, utility calls included, without blocking while
  ``has_work()`` is true: the scheduler holds requests), publishes its request counts to the
  DP coordinator, then ``_process_engine_step`` (the step; ``({}, False)`` puts nothing on the
  output queue, then sleeps 1 ms while the scheduler has requests). So ``has_work``,
  ``is_sleeping`` and every other call are answered within a loop turn (about
  ``HOLD_SLEEP_S``), and the coordinator keeps publishing the held counts.
* **Release.** Removing the file lets the next step schedule as usual: the held requests run
  to completion.
* **Pacing.** While ``<VLLM_DP_E2E_HOLD_DIR>/pace-rank-<rank>`` holds a number of seconds,
  each real step of that rank sleeps that long first: it still computes every token, only
  slower. On 2 cores the tiny model generates faster than vLLM's front end streams, and the
  API server carrying a stream then answers nothing else (its ``/metrics``, ``/dp/status``,
  the plugin's own poll: one ``/dp/status`` took 7.4 s during an 8.4 s stream) until it has
  caught up; paced, the front ends keep up and answer while the rank generates.

Each transition is logged on stderr (the engine's log): ``e2e engine hook: rank N holds`` /
``... steps again``, and the install as ``e2e engine hook: vllm.v1.engine.core patched``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

HOLD_DIR_ENV = "VLLM_DP_E2E_HOLD_DIR"
TARGET = "vllm.v1.engine.core"
#: How long a held step sleeps before it returns (the busy loop's turn while held).
HOLD_SLEEP_S = 0.02
#: Marks a wrapped method (never wrapped twice).
MARK = "__e2e_hold__"


def hold_file(folder: str | os.PathLike[str], rank: int) -> str:
    """The file whose existence makes DP rank ``rank`` hold its requests."""
    return os.path.join(os.fspath(folder), f"hold-rank-{rank}")


def pace_file(folder: str | os.PathLike[str], rank: int) -> str:
    """The file whose number (seconds) each real step of DP rank ``rank`` sleeps first."""
    return os.path.join(os.fspath(folder), f"pace-rank-{rank}")


def _pace(rank: Any, folder: str) -> float:
    """Seconds to sleep before a real step of ``rank`` (0: none, or no readable number)."""
    if not isinstance(rank, int):
        return 0.0
    try:
        with open(pace_file(folder, rank)) as f:
            seconds = float(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0.0
    return min(max(seconds, 0.0), 1.0)


def _say(text: str) -> None:
    print(f"e2e engine hook: {text} (pid {os.getpid()})", file=sys.stderr, flush=True)


def _held(engine: Any, folder: str) -> bool:
    """Whether ``engine`` must not step now; logs each change of its own state."""
    rank = getattr(engine, "engine_index", None)
    held = isinstance(rank, int) and os.path.exists(hold_file(folder, rank))
    if held != getattr(engine, "_e2e_held", False):
        engine._e2e_held = held
        scheduler = getattr(engine, "scheduler", None)
        counts = getattr(scheduler, "get_request_counts", lambda: ("?", "?"))()
        what = "holds its requests" if held else "steps again"
        _say(f"rank {rank} {what} (running {counts[0]}, waiting {counts[1]})")
    if held:
        time.sleep(HOLD_SLEEP_S)
    return held


def _wrap(method: Callable[..., Any], idle: Any, folder: str) -> Callable[..., Any]:
    @functools.wraps(method)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _held(self, folder):
            return idle, False
        pace = _pace(getattr(self, "engine_index", None), folder)
        if pace:
            time.sleep(pace)
        return method(self, *args, **kwargs)

    setattr(step, MARK, True)
    return step


def patch(module: ModuleType, folder: str) -> None:
    """Wrap ``EngineCore.step`` (no-op: ``({}, False)``) and ``step_with_batch_queue``
    (``(None, False)``) of vLLM's engine-core module."""
    cls = module.EngineCore
    for name, idle in (("step", {}), ("step_with_batch_queue", None)):
        method = getattr(cls, name, None)
        if method is not None and not getattr(method, MARK, False):
            setattr(cls, name, _wrap(method, idle, folder))
    _say(f"{TARGET} patched, hold files {hold_file(folder, 0)[:-1]}<rank>")


class _PatchingLoader(importlib.abc.Loader):
    """The real loader, then ``patch`` on the executed module."""

    def __init__(self, loader: importlib.abc.Loader, folder: str) -> None:
        self._loader = loader
        self._folder = folder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        patch(module, self._folder)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ...: the real loader's
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, folder: str) -> None:
        self._folder = folder

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self._folder)
                return spec
        return None


def install(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Install the import hook when ``VLLM_DP_E2E_HOLD_DIR`` is set; True when it did."""
    folder = environ.get(HOLD_DIR_ENV)
    if not folder:
        return False
    if TARGET in sys.modules:  # imported before site ran (not seen): patch it now
        patch(sys.modules[TARGET], folder)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder(folder))
    return True


def _chain_next_sitecustomize() -> None:
    """Import a ``sitecustomize`` later on ``sys.path`` that this one shadows (none in vLLM's
    venv today), so putting this folder first changes nothing else."""
    here = os.path.dirname(os.path.abspath(__file__))
    this = sys.modules.get("sitecustomize")
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        sys.modules.pop("sitecustomize", None)
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if this is not None:
            sys.modules["sitecustomize"] = this


if __name__ == "sitecustomize":  # run by site at start-up; importing it elsewhere does nothing
    install()
    _chain_next_sitecustomize()
