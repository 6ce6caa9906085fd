"""In-process mode: ``InProcessFleetClient`` over vLLM's own engine-core client, inside vLLM's
API server (the ``dp_exporter`` endpoint plugin) or the process that owns an ``AsyncLLM`` (a
trainer's ``start_exporter``); ``vllm_core`` is the one adapter that names vLLM's attributes."""

from exporter.client.inprocess.client import InProcessFleetClient

__all__ = ["InProcessFleetClient"]
