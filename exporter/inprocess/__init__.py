"""In-process mode: the exporter inside vLLM's API server (the ``dp_exporter`` endpoint plugin)
or inside the process that owns an ``AsyncLLM`` (``start_exporter``)."""

from exporter.inprocess.trainer import inprocess_config, start_exporter

__all__ = ["inprocess_config", "start_exporter"]
