"""An example router that keeps OpenAI traffic off the DP ranks the exporter's feed says are not
routable, by pinning each request to a rank with vLLM's ``X-data-parallel-rank`` header
(README.md, docs/routing.md)."""

from examples.router.router import Router, RouterConfig, serve

__all__ = ["Router", "RouterConfig", "serve"]
