"""``python -m tests.system.scale.bulk_engines HANDSHAKE_ADDRESS FIRST COUNT``: many engines in one
process, cheaply: plain blocking pyzmq on one context (its socket limit raised), one
``zmq.Poller`` over every engine's input socket, no asyncio and no per-engine task.

Each engine does the engine side of the handshake (HELLO → INIT → registration + READY) and then
answers every utility call at once (``is_sleeping``/``is_scheduler_paused``: False, anything else:
None). It prints ``ready`` once every engine sent READY and runs until SIGTERM.
"""

from __future__ import annotations

import signal
import sys
from typing import Any

import zmq

from exporter.protocol import (
    HELLO,
    READY,
    decode_init,
    decode_utility_request,
    encode_handshake_message,
    encode_registration,
    encode_utility_reply,
    engine_identity,
    registration_map,
)

ANSWERS: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False}


def main(argv: list[str]) -> int:
    address, first, count = argv[0], int(argv[1]), int(argv[2])
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 3 * count + 16)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    handshakes = []
    for index in range(first, first + count):
        hs = ctx.socket(zmq.DEALER)
        hs.setsockopt(zmq.IDENTITY, engine_identity(index))
        hs.setsockopt(zmq.LINGER, 5000)
        hs.connect(address)
        hs.send(encode_handshake_message(HELLO))
        handshakes.append((index, hs))
    inputs: dict[zmq.Socket[bytes], tuple[int, zmq.Socket[bytes]]] = {}
    for index, hs in handshakes:
        if not hs.poll(60_000):
            print(f"engine {index}: no INIT", file=sys.stderr)
            return 1
        init = decode_init(hs.recv())
        inp = ctx.socket(zmq.DEALER)
        inp.setsockopt(zmq.IDENTITY, engine_identity(index))
        inp.setsockopt(zmq.LINGER, 0)
        inp.connect(init.addresses.inputs[0])
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(init.addresses.outputs[0])
        inp.send(encode_registration(registration_map(index)))
        hs.send(encode_handshake_message(READY))
        hs.close()
        inputs[inp] = (index, out)
    print("ready", flush=True)
    poller = zmq.Poller()
    for sock in inputs:
        poller.register(sock, zmq.POLLIN)
    while not stop:
        for sock, _ in poller.poll(200):
            index, out = inputs[sock]
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                request = decode_utility_request(frames[-1])
                reply = encode_utility_reply(
                    index, request.call_id, value=ANSWERS.get(request.method)
                )
                out.send(reply)
    for sock, (_, out) in inputs.items():
        sock.close(linger=0)
        out.close(linger=0)
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
