"""What a client presents to an exporter's listeners: the admin bearer token, basic-auth
credentials, and the TLS settings (the CA to trust, a client certificate and its key) for an
exporter started with ``--web-config-file`` (docs/security.md).

Secrets live in ``Secret`` objects whose ``repr`` and ``str`` never show the value, so a
traceback, a log line or a debugger printing a ``Credentials`` shows no token or password.
They come from files or from the environment, never from a command line (where every user of
the host can read them in the process table). Files are read once, when loaded.
"""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.config.rules import (
    check_regular_file,
    no_passphrase,
    read_text_file,
    read_token_file,
)
from exporter.error import ConfigError

#: The environment variable ``ctl`` reads basic-auth credentials from (``user:password``).
BASIC_AUTH_ENV = "VLLM_DP_EXPORTER_CTL_BASIC_AUTH"


class Secret:
    """A token or password; ``reveal()`` is the only way to the value."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('********')"

    __str__ = __repr__


def _no_controls(text: str, what: str) -> None:
    if any(not c.isprintable() for c in text):
        raise ConfigError(f"{what}: holds a control character")


@dataclass(frozen=True)
class BasicAuth:
    """A basic-auth user and password (the web config's ``basic_auth_users``)."""

    user: str
    password: Secret = field(repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.password, str):  # a plain string given in code
            object.__setattr__(self, "password", Secret(self.password))
        if not self.user or ":" in self.user:
            raise ConfigError("a basic-auth user must be non-empty and hold no ':'")
        _no_controls(self.user, "the basic-auth user")
        if not self.password.reveal():
            raise ConfigError("the basic-auth password is empty")

    @classmethod
    def parse(cls, text: str, where: str) -> BasicAuth:
        """``user:password`` on one line (a trailing newline is ignored; the password may
        contain ``:``). ``where`` names the source in errors, never the value."""
        line = text.removesuffix("\n").removesuffix("\r")
        if "\n" in line or "\r" in line:
            raise ConfigError(f"{where}: several lines; it must hold user:password on one")
        user, sep, password = line.partition(":")
        if not sep:
            raise ConfigError(f"{where}: must hold user:password")
        _no_controls(password, where)
        try:
            return cls(user, Secret(password))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def from_file(cls, path: str) -> BasicAuth:
        return cls.parse(read_text_file(path, "basic-auth file"), f"basic-auth file {path}")

    @classmethod
    def from_env(
        cls, name: str = BASIC_AUTH_ENV, environ: Mapping[str, str] | None = None
    ) -> BasicAuth | None:
        """The credentials in environment variable ``name``; None when it is unset."""
        env = os.environ if environ is None else environ
        raw = env.get(name)
        return None if raw is None else cls.parse(raw, f"environment variable {name}")

    def header(self) -> str:
        raw = f"{self.user}:{self.password.reveal()}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")


@dataclass(frozen=True, eq=False)
class Credentials:
    """Everything a client presents. All optional: an exporter on loopback without a web
    config needs none.

    ``token`` authenticates admin requests (``--admin-token-file`` of the exporter, the vLLM
    plugin's ``VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE``). ``basic_auth`` authenticates reads on a
    listener with ``basic_auth_users`` (``/status``, ``/gate``) and admin requests when no
    token is given (the exporter then checks basic auth on its admin listener). ``ca_file``
    is the CA that signed the exporter's certificate (default: the system's CAs);
    ``cert_file`` and ``key_file`` are the client certificate for mutual TLS."""

    token: Secret | None = field(default=None, repr=False)
    basic_auth: BasicAuth | None = field(default=None, repr=False)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.token, str):  # a plain string given in code
            object.__setattr__(self, "token", Secret(self.token))
        token = self.token
        if token is not None:
            value = token.reveal()
            if not value or any(c in value for c in "\r\n") or value != value.strip():
                raise ConfigError("the admin token must be one line without surrounding spaces")
        if self.key_file is not None and self.cert_file is None:
            raise ConfigError("a client key needs its certificate (cert_file)")

    def __repr__(self) -> str:
        shown = [
            f"token={'set' if self.token else None}",
            f"basic_auth={'user ' + repr(self.basic_auth.user) if self.basic_auth else None}",
            f"ca_file={self.ca_file!r}",
            f"cert_file={self.cert_file!r}",
            f"key_file={self.key_file!r}",
        ]
        return f"Credentials({', '.join(shown)})"

    @classmethod
    def load(
        cls,
        *,
        token_file: str | None = None,
        token_env: str | None = None,
        basic_auth_file: str | None = None,
        basic_auth_env: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Credentials:
        """Read the token (a file holding it on one line, or the environment variable
        ``token_env``) and the basic-auth credentials (a file, or the environment variable
        ``basic_auth_env``, each ``user:password``). A file wins over the environment.
        ``ConfigError`` names the file or variable that cannot be used, never its value."""
        env = os.environ if environ is None else environ
        token = None
        if token_file is not None:
            token = read_token_file(token_file, "token file")
        elif token_env is not None and env.get(token_env) is not None:
            token = env[token_env].strip()
            if not token or any(c in token for c in "\r\n"):
                raise ConfigError(f"environment variable {token_env}: must hold the token")
        basic = None
        if basic_auth_file is not None:
            basic = BasicAuth.from_file(basic_auth_file)
        elif basic_auth_env is not None:
            basic = BasicAuth.from_env(basic_auth_env, env)
        return cls(
            Secret(token) if token is not None else None,
            basic,
            ca_file=ca_file,
            cert_file=cert_file,
            key_file=key_file,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context: None when nothing is set (https then verifies against
        the system's CAs); else one trusting ``ca_file`` (or the system's CAs) and presenting
        the client certificate. The server's name is always checked."""
        if self.ca_file is None and self.cert_file is None:
            return None
        # Each file a regular one first: ssl opens them by path, and a FIFO would block it.
        for path, what in (
            (self.ca_file, "CA file"),
            (self.cert_file, "client certificate"),
            (self.key_file, "client key file"),
        ):
            if path is not None:
                check_regular_file(path, what)
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"CA file {self.ca_file}: {_reason(exc)}") from None
        if self.cert_file is not None:
            refuse = no_passphrase(f"client key {self.key_file or self.cert_file}")
            try:
                ctx.load_cert_chain(self.cert_file, self.key_file, password=refuse)
            except (OSError, ssl.SSLError) as exc:
                key = f" and key file {self.key_file}" if self.key_file else ""
                raise ConfigError(
                    f"client certificate {self.cert_file}{key}: {_reason(exc)}"
                ) from None
        return ctx

    def admin_authorization(self) -> str | None:
        """The ``Authorization`` header of an admin request: the token when there is one
        (the admin listener's credential), else basic auth."""
        if self.token is not None:
            return f"Bearer {self.token.reveal()}"
        return self.basic_auth.header() if self.basic_auth is not None else None

    def read_authorization(self) -> str | None:
        """The ``Authorization`` header of a read (``/status``, ``/gate``): basic auth only;
        the admin token is never sent where it is not the credential."""
        return self.basic_auth.header() if self.basic_auth is not None else None


def _reason(exc: OSError | ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLError):
        return str(exc.reason or exc).replace("_", " ").lower()
    return exc.strerror or str(exc)
