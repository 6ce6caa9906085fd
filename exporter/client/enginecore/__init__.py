"""The ZMQ engine-core client owner and relay mode share: ``EngineCoreClient`` (``client``: call
ids, one future per fan-out, one shared deadline), the data plane both transports run (input
ROUTER, output PULL, monitor), per-engine link state and the state file. Each mode's handshake
is its own package (``exporter.client.owner``, ``exporter.client.relay``).
"""

import zmq

#: What an engine-facing socket may raise after start-up (a command reports it in one line).
SOCKET_ERRORS: tuple[type[Exception], ...] = (zmq.ZMQError,)
