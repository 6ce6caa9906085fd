"""The engine-facing client, like vLLM's Rust ``engine-core-client`` crate: the ``FleetClient``
interface every attach mode implements (``fleet``), the in-memory ``FakeFleet``, the ZMQ client
(``engine_core``) over its transports (``transport/``: owner and relay handshakes, the data
plane, the state file) and the HTTP client of vLLM's dev endpoints (``http``). Depends on the
wire codec and the base modules only.
"""
