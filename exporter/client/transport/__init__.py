"""The ZMQ transports of ``EngineCoreClient``: owner and relay handshakes, the data plane shared
by both (input ROUTER, output PULL, monitor), per-engine link state and the state file.
"""
