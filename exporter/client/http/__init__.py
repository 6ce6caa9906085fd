"""HTTP mode: ``HttpFleetClient`` over vLLM API servers' dev routes (each server one engine, its
answer vLLM's own aggregate) or over plugin-enabled servers (a URL ending in ``/dp``: one
``/dp/gate`` read per poll, each rank an engine), every answer read up to a fixed limit."""

from exporter.client.http.client import HttpFleetClient
from exporter.client.http.target import HttpTarget

__all__ = ["HttpFleetClient", "HttpTarget"]
