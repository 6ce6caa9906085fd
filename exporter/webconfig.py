"""``--web-config-file``: TLS and basic authentication in Prometheus exporter-toolkit's web
configuration format (the file node_exporter & co. take with ``--web.config.file``)::

    tls_server_config:
      cert_file: server.crt            # paths relative to the web config file
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert
      client_ca_file: ca.crt
      min_version: TLS12
    http_server_config:
      headers: {Strict-Transport-Security: max-age=31536000}
    basic_auth_users:
      prometheus: $2y$10$...           # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')

Everything is checked when the file is loaded (``load_web_config``), with one-line
``ConfigError`` messages naming the file and the key: unknown keys, unreadable or mismatched
certificate files, a ``client_auth_type`` that is none of the five, hashes that are not bcrypt.

Differences from exporter-toolkit, each refused with a message rather than ignored:
``cipher_suites``, ``curve_preferences``, ``client_allowed_sans`` and inline ``cert``/``key``
are not supported; ``RequestClientCert`` and ``RequireAnyClientCert`` need ``client_ca_file``
because Python's TLS stack verifies every client certificate it receives (they behave as
``VerifyClientCertIfGiven`` / ``RequireAndVerifyClientCert``). ``http2`` is accepted and
ignored (the listeners speak HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import ssl
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.error import ConfigError

if TYPE_CHECKING:  # aiohttp is imported where it is used: config loading stays light
    from aiohttp import web

    Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

log = logging.getLogger("exporter.http")

CLIENT_AUTH_TYPES: dict[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
#: exporter-toolkit's older name of RequireAnyClientCert.
CLIENT_AUTH_ALIASES = {"RequireClientCert": "RequireAnyClientCert"}
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
TLS_KEYS = (
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "client_ca",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",
)
TLS_UNSUPPORTED = ("cipher_suites", "curve_preferences", "client_allowed_sans", "cert", "key")
HTTP_KEYS = ("http2", "headers")
#: The response headers exporter-toolkit lets a web config set.
ALLOWED_HEADERS = (
    "Strict-Transport-Security",
    "X-Content-Type-Options",
    "X-Frame-Options",
    "X-XSS-Protection",
    "Content-Security-Policy",
)
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
#: Paths answered without basic auth (probes; neither reveals engine addresses). TLS, being the
#: listener's, covers them too.
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
REALM = 'Basic realm="vllm-dp-exporter", charset="UTF-8"'
#: A valid cost-10 hash of a random password: unknown users cost as much as known ones.
_DUMMY_HASH = b"$2b$10$RmNe6gf7JJmtmro4OsliaOdfK2ybDX7qw.ZG0M7zJiiv3/Obc0P9K"


@dataclass(frozen=True)
class WebConfig:
    """A loaded web configuration: ``ssl_context`` is None for plain HTTP; ``users`` maps a
    username (UTF-8 bytes) to its bcrypt hash, empty for no basic auth."""

    path: str
    ssl_context: ssl.SSLContext | None = field(default=None, compare=False)
    client_auth_type: str = "NoClientCert"
    users: Mapping[bytes, bytes] = field(default_factory=dict, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_context is not None else "http"


def _mapping(
    where: str, value: Any, keys: Collection[str], unsupported: Collection[str] = ()
) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
    for key in value:
        if key in unsupported:
            raise ConfigError(f"{where}: {key} is not supported by vllm-dp-exporter")
        if key not in keys:
            raise ConfigError(f"{where}: unknown key {key!r} (known: {', '.join(keys)})")
    return value


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def _readable(where: str, base: Path, value: Any) -> str:
    path = base / _string(where, value)
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        raise ConfigError(f"{where} {path}: {exc.strerror or exc}") from None
    return str(path)


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc).replace("_", " ").lower()


def _tls_context(where: str, base: Path, tls: dict[str, Any]) -> tuple[ssl.SSLContext, str]:
    if "cert_file" not in tls or "key_file" not in tls:
        raise ConfigError(f"{where} needs cert_file and key_file")
    cert = _readable(f"{where}.cert_file", base, tls["cert_file"])
    key = _readable(f"{where}.key_file", base, tls["key_file"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    for name, attr in (("min_version", "minimum_version"), ("max_version", "maximum_version")):
        if tls.get(name) is None:
            continue
        version = TLS_VERSIONS.get(tls[name])
        if version is None:
            raise ConfigError(
                f"{where}.{name} must be one of {', '.join(TLS_VERSIONS)}, got {tls[name]!r}"
            )
        setattr(ctx, attr, version)
    if tls.get("min_version") is None:
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{where}: cert_file {cert} and key_file {key} are not a PEM certificate and its "
            f"private key ({_ssl_reason(exc)})"
        ) from None
    prefer = tls.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{where}.prefer_server_cipher_suites must be true or false")
    if prefer:
        ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    raw_auth = tls.get("client_auth_type") or "NoClientCert"
    auth = CLIENT_AUTH_ALIASES.get(raw_auth, raw_auth)
    if auth not in CLIENT_AUTH_TYPES:
        raise ConfigError(
            f"{where}.client_auth_type must be one of {', '.join(CLIENT_AUTH_TYPES)}, "
            f"got {raw_auth!r}"
        )
    has_ca = tls.get("client_ca_file") is not None or tls.get("client_ca") is not None
    if auth == "NoClientCert" and has_ca:
        raise ConfigError(
            f"{where}: a client CA is set but client_auth_type is NoClientCert (set "
            "client_auth_type, e.g. RequireAndVerifyClientCert)"
        )
    if auth != "NoClientCert" and not has_ca:
        raise ConfigError(
            f"{where}.client_auth_type {auth} needs client_ca_file (Python's TLS stack "
            "verifies every client certificate it requests)"
        )
    try:
        if tls.get("client_ca_file") is not None:
            ca = _readable(f"{where}.client_ca_file", base, tls["client_ca_file"])
            ctx.load_verify_locations(cafile=ca)
        if tls.get("client_ca") is not None:
            ctx.load_verify_locations(cadata=_string(f"{where}.client_ca", tls["client_ca"]))
    except ssl.SSLError as exc:
        raise ConfigError(
            f"{where}: the client CA is not a PEM certificate ({_ssl_reason(exc)})"
        ) from None
    ctx.verify_mode = CLIENT_AUTH_TYPES[auth]
    return ctx, auth


def _users(where: str, value: Any) -> dict[bytes, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of username to bcrypt hash")
    users = {}
    for name, hashed in value.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(f"{where}: username {name!r} must be a non-empty string without ':'")
        # Never echo a hash: it is offline-attackable.
        if not isinstance(hashed, str) or not BCRYPT_HASH.fullmatch(hashed):
            raise ConfigError(
                f"{where}.{name}: not a bcrypt hash ($2a$/$2b$/$2y$, cost 04-31, 53 characters)"
            )
        users[name.encode()] = hashed.encode()
    return users


def _headers(where: str, value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of header to value")
    allowed = {h.lower(): h for h in ALLOWED_HEADERS}
    out = {}
    for name, text in value.items():
        canonical = allowed.get(str(name).lower())
        if canonical is None:
            raise ConfigError(
                f"{where}: header {name!r} may not be set (allowed: {', '.join(ALLOWED_HEADERS)})"
            )
        if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
            raise ConfigError(f"{where}.{name} must be a one-line string")
        out[canonical] = text
    return out


def load_web_config(path: str) -> WebConfig:
    """Read and check the file; build the TLS context. ``ConfigError`` (one line) otherwise."""
    import yaml  # here: importing the settings stays light when no web config is used

    where = f"web config file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{where}: invalid YAML{at}: {problem}") from None
    top = _mapping(where, data, TOP_KEYS)
    base = Path(path).parent
    tls = _mapping(
        f"{where}: tls_server_config", top.get("tls_server_config"), TLS_KEYS, TLS_UNSUPPORTED
    )
    http = _mapping(f"{where}: http_server_config", top.get("http_server_config"), HTTP_KEYS)
    if "http2" in http and not isinstance(http["http2"], bool):
        raise ConfigError(f"{where}: http_server_config.http2 must be true or false")
    ctx, auth = (None, "NoClientCert")
    if top.get("tls_server_config") is not None:
        ctx, auth = _tls_context(f"{where}: tls_server_config", base, tls)
    return WebConfig(
        path=path,
        ssl_context=ctx,
        client_auth_type=auth,
        users=_users(f"{where}: basic_auth_users", top.get("basic_auth_users")),
        headers=_headers(f"{where}: http_server_config.headers", http.get("headers")),
    )


class BasicAuth:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes.

    bcrypt costs ~100 ms per check by design, so verdicts are cached: the key is an HMAC
    (with a per-process random key) of the username and password, never the password itself,
    and the cache is a bounded LRU. At most ``max_concurrent`` checks run at once, in threads
    (the event loop, hence the poller, keeps running). Unknown users are checked against a
    dummy hash, so they take as long as known ones; the comparison is constant-time."""

    def __init__(
        self, users: Mapping[bytes, bytes], *, cache_size: int = 256, max_concurrent: int = 4
    ) -> None:
        self._users = dict(users)
        self._key = os.urandom(32)
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._cache_size = cache_size
        self._slots = asyncio.Semaphore(max_concurrent)
        self.bcrypt_checks = 0

    @staticmethod
    def parse(header: str) -> tuple[bytes, bytes] | None:
        scheme, _, encoded = header.strip().partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user, sep, password = decoded.partition(b":")
        return (user, password) if sep else None

    def _check(self, user: bytes, password: bytes) -> bool:
        import bcrypt

        known = user in self._users
        hashed = self._users.get(user, _DUMMY_HASH)
        self.bcrypt_checks += 1
        try:
            computed = bcrypt.hashpw(password, hashed)
        except ValueError:  # a password longer than bcrypt's 72 bytes
            return False
        return hmac.compare_digest(computed, hashed) and known

    async def check(self, header: str) -> bool:
        """Whether ``header`` (an Authorization header's value) names a user and its password."""
        parsed = self.parse(header)
        if parsed is None:
            return False
        user, password = parsed
        digest = hmac.new(
            self._key, len(user).to_bytes(4, "big") + user + password, hashlib.sha256
        ).digest()
        cached = self._cache.get(digest)
        if cached is None:
            async with self._slots:
                cached = await asyncio.to_thread(self._check, user, password)
            self._cache[digest] = cached
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(digest)
        return cached


def unauthorized() -> web.Response:
    from aiohttp import web

    return web.Response(status=401, text="Unauthorized\n", headers={"WWW-Authenticate": REALM})


def protect(
    app: web.Application,
    config: WebConfig | None,
    *,
    basic_auth: bool = True,
    open_paths: Collection[str] = OPEN_PATHS,
) -> None:
    """Apply ``config`` to ``app`` (before it starts): the configured response headers, and
    (``basic_auth``) a middleware asking every path but ``open_paths`` for basic auth. TLS is
    the listener's: ``config.ssl_context`` goes to the ``TCPSite``."""
    from aiohttp import web

    if config is None:
        return
    if config.headers:
        headers = dict(config.headers)

        async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
            for name, value in headers.items():  # a header the route set itself is kept
                response.headers.setdefault(name, value)

        app.on_response_prepare.append(add_headers)
    if basic_auth and config.users:
        checker = BasicAuth(config.users)

        @web.middleware
        async def require_basic_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.path not in open_paths and not await checker.check(
                request.headers.get("Authorization", "")
            ):
                log.debug(
                    "%s %s from %s: basic auth missing or wrong",
                    request.method,
                    request.path,
                    request.remote,
                )
                return unauthorized()
            return await handler(request)

        app.middlewares.append(require_basic_auth)
