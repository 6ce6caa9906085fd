"""What can go wrong when talking to a running exporter, as part of the exporter's one typed
error family (``exporter.error.ExporterError``).

Each HTTP answer that is not a success maps to one class, so a training script can tell the
cases it handles apart (``except PartialFailure``: some ranks did not take the action;
``except Conflict``: another action is running; ``except Unreachable``: try again later)
without reading status codes. Every error keeps what the exporter said: ``status``, the JSON
``body`` when there was one (``None`` when the answer was not JSON), and ``detail``, the
exporter's own error text with control characters escaped.

``PartialFailure`` (HTTP 502) and ``NoEngineConnected`` (503) of an admin action carry the
typed ``result`` with every engine's outcome: nothing is rolled back on a partial failure, so
the caller needs to know which engine is in which state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from exporter.remote.errorbase import InvalidAnswer as InvalidAnswer
from exporter.remote.errorbase import RemoteError as RemoteError

if TYPE_CHECKING:
    from exporter.remote.results import ActionResult, GateResult


class Unreachable(RemoteError):
    """No answer: connection refused or reset, a name that does not resolve, a TLS handshake
    that failed (an untrusted server certificate, a client certificate refused), or no answer
    within the call's timeout. Safe to retry reads; retry writes only with an Idempotency-Key."""


class BadRequest(RemoteError):
    """400 (or 408/413): the exporter rejected the request itself (a bad parameter, body or
    Idempotency-Key); ``detail`` names the parameter. Retrying the same request cannot help."""


class IdempotencyKeyReused(BadRequest):
    """422: this Idempotency-Key was used with other parameters; use a new key."""


class AuthError(RemoteError):
    """401: missing or wrong credentials (the admin token, or basic-auth user and password);
    403: refused by policy (relay mode's state changes, the vLLM plugin's admin routes without
    its token)."""


class Forbidden(AuthError):
    """403: the credentials are fine (or not needed) but the exporter refuses this action."""


class NotFound(RemoteError):
    """404/405: no such route at this URL (the metrics listener asked for an admin action, a
    base URL without the plugin's ``/dp`` prefix, an exporter too old for this action)."""


class Conflict(RemoteError):
    """409: another admin action is running (one at a time, across all actions), or the first
    request with this Idempotency-Key still is. Nothing was sent to the engines."""


class RateLimited(RemoteError):
    """429: an action's minimum interval (the prefix-cache reset's), or too many failed
    authentication attempts from this address. ``retry_after`` is the server's
    ``Retry-After`` in seconds (None when it sent none)."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class NoEngineConnected(RemoteError):
    """503: no engine is connected; nothing was sent. ``result`` is the action's answer (every
    engine list empty) when it was one."""

    def __init__(self, message: str, *, result: ActionResult | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result


class PartialFailure(RemoteError):
    """502: at least one engine did not confirm the action. Nothing is rolled back: ``result``
    says, per engine, whether it confirmed, why not (``reason``) and the state read back."""

    def __init__(self, message: str, *, result: ActionResult, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.result = result


class Unsupported(RemoteError):
    """501: no engine supports what was asked (every engine's vLLM lacks the method, or an
    engine registered without the feature, e.g. sleep mode): nothing was changed and retrying
    cannot help. ``result`` is the action's answer (every engine ``reason`` ``unsupported``);
    for the gate, ``conditions`` names the conditions no engine can answer. A *mix* (some
    engines support it) is a ``PartialFailure`` naming the unsupported engines."""

    def __init__(
        self,
        message: str,
        *,
        result: ActionResult | None = None,
        conditions: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(message, **kwargs)
        self.result = result
        self.conditions = conditions


class HttpError(RemoteError):
    """Any other status (a 500 from a bug, a 5xx from a proxy in between, a redirect, which
    the client never follows: it would carry the credentials elsewhere)."""


class WaitTimeout(RemoteError, TimeoutError):
    """``wait`` ran out of time before the gate opened. ``last`` is the gate's last answer
    (None when none came), ``last_error`` what the last check said (``HTTP 412``, or why the
    exporter could not be asked)."""

    def __init__(
        self, message: str, *, last: GateResult | None, last_error: str, **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)
        self.last = last
        self.last_error = last_error
