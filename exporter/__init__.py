"""vllm-dp-exporter: per-engine observability and admin actions for vLLM data-parallel fleets."""

__version__ = "0.1.0"
