"""The root of ``exporter.remote``'s errors: ``RemoteError``, the base of every one, and
``InvalidAnswer``, what the pure reading of answers (``exporter.remote.results``) raises.

``exporter.remote.errors`` holds the rest of the family and re-exports both. Its errors carry
typed results (``PartialFailure.result``), so the results cannot import it: they import this
module, and the imports run one way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exporter.error import ExporterError


class RemoteError(ExporterError):
    """Base of every error of ``exporter.remote``: the exporter could not be asked, or it
    answered something other than a success."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        body: Mapping[str, Any] | None = None,
        detail: str | None = None,
        url: str | None = None,
    ) -> None:
        super().__init__(message)
        #: The HTTP status of the answer (None: no answer at all).
        self.status = status
        #: The answer's JSON object (None: no answer, or not a JSON object).
        self.body = body
        #: The exporter's error text, or why the answer could not be read; printable.
        self.detail = detail if detail is not None else message
        #: The URL asked (never carries credentials: ``exporter.remote.urls`` refuses them).
        self.url = url


class InvalidAnswer(RemoteError):
    """The answer is not the exporter's API: not JSON, not a JSON object, a field of the wrong
    type, or larger than the client reads (something else listens on that address?)."""
