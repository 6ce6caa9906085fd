"""Base URLs of an exporter and the routes under them.

A base URL may carry a path prefix: the vLLM plugin serves the exporter's routes under
``http://host:8000/dp``, so ``status`` is ``<url>/status`` and an action is
``<admin_url>/admin/<action>`` whatever the prefix. Credentials in a URL
(``http://user:pw@host``) are refused: a URL ends up in error messages and logs, so basic auth
goes in ``Credentials``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from exporter.error import ConfigError


def base_url(url: str, what: str = "URL") -> str:
    """``url`` checked and without a trailing slash; ``ConfigError`` naming ``what``."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{what}: must be a non-empty string")
    if any(not c.isprintable() or c.isspace() for c in url):
        raise ConfigError(f"{what} {url!r}: holds a space or a control character")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number or out of range
    except ValueError as exc:
        raise ConfigError(f"{what} {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{what} {url!r}: must start with http:// or https://")
    if not parts.hostname:
        raise ConfigError(f"{what} {url!r}: names no host")
    if parts.username is not None or parts.password is not None:
        raise ConfigError(f"{what}: must not carry credentials; give them as basic auth instead")
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ConfigError(f"{what} {url!r}: must not carry a query or fragment")
    if port == 0:
        raise ConfigError(f"{what} {url!r}: port 0 is not a port to connect to")
    return url.rstrip("/")


def join(base: str, route: str) -> str:
    """``base`` (from ``base_url``) and ``route`` (``status``, ``admin/sleep``)."""
    return f"{base}/{route.lstrip('/')}"
