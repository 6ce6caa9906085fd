"""vLLM general plugin ``dp_exporter`` (entry-point group ``vllm.general_plugins``): one line in
``vllm serve``'s own process when vLLM's Rust front end (``VLLM_USE_RUST_FRONTEND=1``) replaces
its Python API server, where the ``dp_exporter`` endpoint plugin can never run.

vLLM calls general plugins in every one of its processes (the ``vllm serve`` process, each
engine core, each worker), and every installed one unless ``VLLM_PLUGINS`` names others: so
this module imports nothing of the exporter's and does nothing unless the Rust front end is on,
and speaks only in the main process (engine cores and workers are vLLM's child processes).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Mapping

#: vLLM's logger namespace: the line comes out in vLLM's own format, beside its start-up lines.
LOGGER = "vllm.dp_exporter"
NOTICE = (
    "vllm-dp-exporter: VLLM_USE_RUST_FRONTEND=1 runs vLLM's Rust front end, which loads no "
    "Python plugin: the dp_exporter plugin's /dp/ routes and vllm_dp_* series are not served. "
    "For per-engine truth beside the Rust front end run the exporter in relay mode (between "
    "headless engines and the front end) or in HTTP mode over its dev routes: "
    "docs/deployment-rust-front-end.md"
)


def rust_front_end_on(environ: Mapping[str, str]) -> bool:
    """vLLM's own reading of ``VLLM_USE_RUST_FRONTEND``: an integer, on when not zero."""
    try:
        return bool(int(environ.get("VLLM_USE_RUST_FRONTEND", "0")))
    except ValueError:
        return False


def rust_front_end_notice(
    environ: Mapping[str, str] | None = None, process_name: str | None = None
) -> bool:
    """The entry point vLLM calls: log ``NOTICE`` once when the Rust front end is on and this
    is vLLM's main process; True when it logged. Never raises (it runs inside vLLM)."""
    try:
        env = os.environ if environ is None else environ
        name = multiprocessing.current_process().name if process_name is None else process_name
        if not rust_front_end_on(env) or name != "MainProcess":
            return False
        logging.getLogger(LOGGER).warning(NOTICE)
        return True
    except Exception:  # a plugin must never stop vLLM
        return False
