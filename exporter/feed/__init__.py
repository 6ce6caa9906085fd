"""Each rank's row pushed to routers: ``GET /watch`` (Server-Sent Events) and the ZMQ load
publisher in SGLang's framing (docs/watch.md, docs/routing.md)."""
