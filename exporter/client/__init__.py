"""The engine-facing client, like vLLM's Rust ``engine-core-client`` crate: the ``FleetClient``
interface every attach mode implements (``fleet``), the in-memory ``FakeFleet`` (``fake``), what
engines say unasked (``pushes``), and one package per attach mode:

- ``owner``: the exporter owns the engines' start-up handshake (``owner.transport``);
- ``relay``: it relays the handshake to a stock vLLM front end and keeps a slot of its own
  (``relay.transport``);
- ``http``: vLLM API servers' dev routes, or a plugin-enabled server's ``/dp/gate``;
- ``inprocess``: vLLM's own engine-core client, inside its API server or a trainer's process;

``enginecore`` is the ZMQ engine-core client owner and relay mode share (call ids, fan-out, the
data plane, link state, the state file). Mode packages use ``fleet``, ``pushes`` and (the two
ZMQ modes) ``enginecore``, never each other. Depends on the wire codec and the base modules.
"""
