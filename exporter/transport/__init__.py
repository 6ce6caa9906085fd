"""Sockets and peers: the ZMQ handshake owner (and relay), and the HTTP dev-endpoint transport."""
