"""One typed error family: every error the exporter raises on purpose is an ``ExporterError``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class ExporterError(Exception):
    """Base of every error the exporter raises on purpose."""


class ConfigError(ExporterError):
    """The configuration is invalid; the message says which setting and why."""


class ProtocolError(ExporterError):
    """A frame or peer violated the engine-core protocol.

    ``kind`` is a short stable label (``not_msgpack``, ``wrong_shape`` ...) used as the
    ``kind`` label of ``vllm_dp_protocol_errors_total``.
    """

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class HandshakeError(ExporterError):
    """The start-up handshake could not complete (timeout, rejected engine, bad INIT)."""


class EngineUnavailable(ExporterError):
    """An engine cannot be sent to right now (not handshaken, dead, refused or not routable)."""


class MethodNotAllowed(ExporterError):
    """The exporter refuses to send a utility method that is not on its allow-list."""


class InconsistentUtilityResults(ExporterError):
    """Engines returned different results for a call that needs consensus.

    ``values`` holds every engine's value in engine order; an empty list means no engine
    produced a result at all (the error vLLM's Rust client raises in that case too).
    """

    def __init__(
        self, method: str, values: Sequence[Any], engines: Sequence[str] | None = None
    ) -> None:
        self.method = method
        self.values = list(values)
        self.engines = list(engines) if engines is not None else None
        if not self.values:
            text = f"no engine returned a {method} result"
        elif self.engines is not None:
            named = zip(self.engines, self.values, strict=False)
            pairs = ", ".join(f"engine {e}: {v!r}" for e, v in named)
            text = f"engines returned different {method} results: {pairs}"
        else:
            text = f"engines returned different {method} results: {self.values!r}"
        super().__init__(text)


class StartupError(ExporterError):
    """The service could not start: a socket could not be bound (the message names it). The
    engine-facing client raises it for its own sockets, so nothing above it knows ZMQ."""
