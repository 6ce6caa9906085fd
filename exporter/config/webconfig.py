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
``ConfigError`` messages naming the file and the key: unknown keys, a key given twice in one
mapping (exporter-toolkit's strict YAML refuses it too; otherwise the last would silently win),
nesting too deep to read, unreadable or mismatched certificate files, a ``client_auth_type``
that is none of the five, a ``min_version`` above ``max_version`` (no handshake could succeed),
hashes that are not bcrypt. Basic auth itself is ``exporter.web.basicauth``.

Differences from exporter-toolkit, each refused with a message rather than ignored:
``cipher_suites``, ``curve_preferences``, ``client_allowed_sans`` and inline ``cert``/``key``
are not supported; ``RequestClientCert`` and ``RequireAnyClientCert`` need ``client_ca_file``
because Python's TLS stack verifies every client certificate it receives (they behave as
``VerifyClientCertIfGiven`` / ``RequireAndVerifyClientCert``). ``http2`` is accepted and
ignored (the listeners speak HTTP/1.1).
"""

from __future__ import annotations

import re
import reprlib
import ssl
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.config.rules import check_regular_file, no_passphrase, read_text_file
from exporter.error import ConfigError

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
DEFAULT_MIN_VERSION = "TLS12"
#: Values quoted in messages are cut short: a YAML alias can make a small file a huge value.
_short = reprlib.Repr()
_short.maxlevel, _short.maxstring, _short.maxother = 3, 60, 60


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
            raise ConfigError(f"{where}: unknown key {_short.repr(key)} (known: {', '.join(keys)})")
    return value


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {_short.repr(value)}")
    return value


def _readable(where: str, base: Path, value: Any) -> str:
    """A regular file (``ssl`` then opens it by path: a FIFO would block the start)."""
    path = base / _string(where, value)
    check_regular_file(str(path), where)
    return str(path)


def _ssl_reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc).replace("_", " ").lower()


def _tls_context(where: str, base: Path, tls: dict[str, Any]) -> tuple[ssl.SSLContext, str]:
    if "cert_file" not in tls or "key_file" not in tls:
        raise ConfigError(f"{where} needs cert_file and key_file")
    cert = _readable(f"{where}.cert_file", base, tls["cert_file"])
    key = _readable(f"{where}.key_file", base, tls["key_file"])
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    lowest, highest = _tls_versions(where, tls)
    ctx.minimum_version = TLS_VERSIONS[lowest]
    if highest is not None:
        ctx.maximum_version = TLS_VERSIONS[highest]
    try:
        ctx.load_cert_chain(cert, key, password=no_passphrase(f"{where}.key_file {key}"))
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
    auth = CLIENT_AUTH_ALIASES.get(raw_auth, raw_auth) if isinstance(raw_auth, str) else None
    if auth not in CLIENT_AUTH_TYPES:
        raise ConfigError(
            f"{where}.client_auth_type must be one of {', '.join(CLIENT_AUTH_TYPES)}, "
            f"got {_short.repr(raw_auth)}"
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


def _tls_versions(where: str, tls: dict[str, Any]) -> tuple[str, str | None]:
    """The names of the lowest and highest TLS versions (None: no upper bound), refusing a
    range no handshake could use."""
    names: dict[str, str | None] = {}
    for name in ("min_version", "max_version"):
        value = tls.get(name)
        if value is not None and (not isinstance(value, str) or value not in TLS_VERSIONS):
            raise ConfigError(
                f"{where}.{name} must be one of {', '.join(TLS_VERSIONS)}, got {_short.repr(value)}"
            )
        names[name] = value
    lowest, highest = names["min_version"] or DEFAULT_MIN_VERSION, names["max_version"]
    if highest is not None and TLS_VERSIONS[lowest] > TLS_VERSIONS[highest]:
        default = "" if names["min_version"] else " (the default)"
        raise ConfigError(
            f"{where}: min_version {lowest}{default} is above max_version {highest}: no "
            "handshake can succeed"
        )
    return lowest, highest


def _users(where: str, value: Any) -> dict[bytes, bytes]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping of username to bcrypt hash")
    users = {}
    for name, hashed in value.items():
        if not isinstance(name, str) or not name or ":" in name:
            raise ConfigError(
                f"{where}: username {_short.repr(name)} must be a non-empty string without ':'"
            )
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
                f"{where}: header {_short.repr(name)} may not be set "
                f"(allowed: {', '.join(ALLOWED_HEADERS)})"
            )
        if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
            raise ConfigError(f"{where}.{name} must be a one-line string")
        if canonical in out:  # header names are case-insensitive: one would silently win
            raise ConfigError(f"{where}: {canonical} is set twice")
        out[canonical] = text
    return out


def _duplicate_keys(where: str, root: Any) -> None:
    """Refuse a key given twice in one mapping (PyYAML keeps the last one silently). Walks the
    composed nodes without recursion, each node once (aliases share nodes)."""
    import yaml

    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else None
                if name is not None and key.tag != "tag:yaml.org,2002:merge":
                    if (key.tag, name) in keys:
                        at = f"{path}: " if path else ""
                        raise ConfigError(
                            f"{where}: {at}duplicate key {_short.repr(name)} at line "
                            f"{key.start_mark.line + 1} (each key may be given once)"
                        )
                    keys.add((key.tag, name))
                stack.append((value, f"{path}.{name}" if path else str(name)))


def _parse_yaml(where: str, text: str) -> Any:
    """``yaml.safe_load``, refusing duplicate keys (``ConfigError``)."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _duplicate_keys(where, node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_web_config(path: str) -> WebConfig:
    """Read and check the file; build the TLS context. ``ConfigError`` (one line) otherwise."""
    import yaml  # here: importing the settings stays light when no web config is used

    where = f"web config file {path}"
    text = read_text_file(path, "web config file")
    try:
        data = _parse_yaml(where, text)
    except RecursionError:
        raise ConfigError(f"{where}: invalid YAML: nested too deeply") from None
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
