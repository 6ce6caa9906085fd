"""In-process mode: the exporter inside vLLM's API server (the ``dp_exporter`` endpoint plugin)
or inside the process that owns an ``AsyncLLM`` (``start_exporter``).

``start_exporter`` and ``inprocess_config`` are imported on first use, so that vLLM's general
plugin hook (``exporter.inprocess.general_plugin``, called in every vLLM process) imports
nothing else of the exporter's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from exporter.inprocess.trainer import inprocess_config, start_exporter

__all__ = ["inprocess_config", "start_exporter"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from exporter.inprocess import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
