"""One typed configuration for ``serve``: flags, then ``VLLM_DP_EXPORTER_*`` environment
variables, then an optional config file (JSON, or TOML on Python 3.11+), then defaults.

Everything is validated at start with one-line messages that name the setting: types (a config
file's values), ranges (``config_rules.BOUNDS``: non-finite, negative and out-of-range numbers
are refused), files (UTF-8, a token on one line) and how settings fit together.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from exporter.base.eventloop import event_loop_value, resolve_event_loop
from exporter.base.logs import (
    DEFAULT_FORMAT,
    DEFAULT_LEVEL,
    add_logging_arguments,
    log_format_value,
    log_level_value,
)
from exporter.config.options import OPTIONS, parse_switch
from exporter.config.rules import (
    HIGHEST_PORT,
    check_bounds,
    check_type,
    flag,
    open_to_everyone,
    read_text_file,
    read_token_file,
    split_targets,
    target_lines,
    unknown_env,
)
from exporter.config.webconfig import WebConfig, load_web_config
from exporter.error import ConfigError

ENV_PREFIX = "VLLM_DP_EXPORTER_"


#: An engine waits 5 minutes for INIT from the moment it sent HELLO. The relay drops a HELLO
#: still queued for the front end a little before that, so a front end that comes up late never
#: receives a HELLO from an engine that has already given up.
RELAY_UPSTREAM_TIMEOUT_S = 295.0
#: ``inprocess`` is set by the vLLM endpoint plugin and the embedding API (``exporter.inprocess``),
#: never by ``serve``: it needs vLLM's engine-core client, which only those hold.
ATTACH_MODES = ("owner", "relay", "http", "inprocess")


@dataclass(frozen=True)
class ServeConfig:
    """Validated settings of a running exporter."""

    attach: str = "owner"
    engine_count: int = 0
    handshake_address: str = ""
    start_rank: int = 0
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    fixed_base_port: int | None = None
    upstream_handshake_address: str | None = None
    state_file: str | None = None
    relay_upstream_timeout: float = RELAY_UPSTREAM_TIMEOUT_S
    http_target: tuple[str, ...] = ()
    http_targets_file: str | None = None
    http_token_file: str | None = None
    listen: str = "0.0.0.0:19400"
    admin_listen: str = "127.0.0.1:19401"
    admin_token_file: str | None = None
    poll_interval: float = 5.0
    call_timeout: float = 10.0
    poll_jitter: float = 0.1
    model_name: str | None = None
    reset_min_interval: float = 1.0
    reset_timeout: float | None = None
    shutdown_grace: float = 3.0
    action_timeout: float = 60.0
    verify_weights_timeout: float = 300.0
    gate_min_interval: float = 0.2
    #: ``GET /watch`` connections at once (0: the feed refuses every one).
    max_watchers: int = 16
    #: ``tcp://HOST:BASE``: each rank's load on its own ZMQ PUB socket (None: off).
    load_publisher: str | None = None
    #: Seconds without any answer, connection alive, before a rank is hung (0: automatic).
    hung_after: float = 0.0
    #: Seconds a rank holding requests may compute no token before it is stalled (0: never).
    stall_after: float = 120.0
    #: Engines read at once in a poll; more are read in bursts spread over the interval
    #: (``exporter.control.pacing``; 0: every engine at once).
    engines_per_burst: int = 16
    relay_allow_state_changes: bool = False
    web_config_file: str | None = None
    log_level: str = DEFAULT_LEVEL
    log_format: str = DEFAULT_FORMAT
    event_loop: str = "auto"
    admin_token: str | None = field(default=None, repr=False)  # read from admin_token_file
    web: WebConfig | None = field(default=None, repr=False)  # loaded from web_config_file
    #: The entries of ``http_targets_file`` and the token of ``http_token_file``, read once
    #: when the configuration is resolved (HTTP mode).
    http_file_targets: tuple[str, ...] = field(default=(), repr=False)
    http_token: str | None = field(default=None, repr=False)

    def fleet_shape(self) -> dict[str, Any]:
        """The keyword arguments of ``FleetShape`` (owner and relay mode)."""
        return {
            "engine_count": self.engine_count,
            "start_rank": self.start_rank,
            "advertise_host": self.advertise_host,
            "bind_host": self.bind_host,
            "fixed_base_port": self.fixed_base_port,
            "state_file": self.state_file,
        }

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return parse_host_port(self.listen, "listen")

    @property
    def load_publisher_host_port(self) -> tuple[str, int] | None:
        """``--load-publisher``'s host and base port (None: off)."""
        if self.load_publisher is None:
            return None
        return parse_host_port(self.load_publisher.removeprefix("tcp://"), "load-publisher")

    @property
    def admin_host_port(self) -> tuple[str, int] | None:
        if self.admin_listen in ("", "off", "none"):
            return None
        return parse_host_port(self.admin_listen, "admin-listen")


#: Set on the command line by ``exporter.base.logs.add_logging_arguments`` (any subcommand).
LOGGING_OPTIONS = ("log_level", "log_format")
#: Fields filled by ``validate`` from other settings, never set directly.
DERIVED = frozenset({"admin_token", "web", "http_file_targets", "http_token"})
_TYPES = {name: conv for name, conv, _ in OPTIONS}
_HINTS = typing.get_type_hints(ServeConfig)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags default to None so that environment and file values can fill the gaps."""
    defaults = {f.name: f.default for f in fields(ServeConfig)}
    for name, conv, text in OPTIONS:
        if name in LOGGING_OPTIONS:
            continue
        flag = "--" + name.replace("_", "-")
        default = defaults.get(name)
        if default not in (None, "", (), 0) or name == "start_rank":
            text = f"{text} (default: {default})"
        text += f"; env {ENV_PREFIX}{name.upper()}"
        if name == "http_target":
            parser.add_argument(flag, action="append", default=None, help=text)
        elif conv is parse_switch:
            parser.add_argument(flag, type=conv, nargs="?", const=True, default=None, help=text)
        else:
            parser.add_argument(flag, type=conv, default=None, help=text)
    add_logging_arguments(parser)


def _load_file(path: str) -> dict[str, Any]:
    p = Path(path)
    text = read_text_file(path, "config file")
    try:
        if p.suffix != ".toml":
            data: Any = json.loads(text)
        elif sys.version_info >= (3, 11):
            import tomllib

            data = tomllib.loads(text)
        else:
            raise ConfigError("TOML config files need Python 3.11+; use JSON")
    except ValueError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    except RecursionError:  # both decoders recurse once per level of nesting
        raise ConfigError(f"config file {path}: nested too deeply to be a config file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table/object at the top level")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def env_warnings(environ: Mapping[str, str] | None = None) -> list[str]:
    """Warnings for ``VLLM_DP_EXPORTER_*`` variables that are no setting (a misspelling is
    otherwise silently ignored)."""
    env = os.environ if environ is None else environ
    known = [f.name for f in fields(ServeConfig) if f.name not in DERIVED] + ["config"]
    return unknown_env(env, ENV_PREFIX, known)


def secret_file_warnings(config: ServeConfig) -> list[str]:
    """One warning per token file every user on the host can read (logged by ``serve``)."""
    files = [("--admin-token-file", config.admin_token_file)]
    if config.attach == "http":
        files.append(("--http-token-file", config.http_token_file))
    found = (open_to_everyone(path, what) for what, path in files if path)
    return [warning for warning in found if warning is not None]


def resolve_config(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ServeConfig:
    """Merge flags > environment > file > defaults (> for keyword overrides: highest)."""
    env = os.environ if environ is None else environ
    flags = {k: v for k, v in vars(args).items() if v is not None} if args else {}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    config_path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    from_file = _load_file(config_path) if config_path else {}
    values: dict[str, Any] = {}
    known = {f.name for f in fields(ServeConfig)}
    for key in from_file:
        if key not in known or key in DERIVED:
            raise ConfigError(f"config file: unknown setting {key!r}")
    for name in known - DERIVED:
        env_key = ENV_PREFIX + name.upper()
        if name in flags:
            values[name] = check_type(flag(name), flags[name], _HINTS[name])
        elif env_key in env:
            raw = env[env_key]
            try:
                if name == "http_target":
                    values[name] = tuple(split_targets(raw))
                else:
                    values[name] = _TYPES[name](raw)
            except ValueError:
                raise ConfigError(f"{env_key}={raw!r} is not a valid {name}") from None
        elif name in from_file:
            where = f"config file {config_path}: {name}"
            values[name] = check_type(where, from_file[name], _HINTS[name])
    return validate(ServeConfig(**values))


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"--{what} must be HOST:PORT, got {text!r}")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"--{what}: port {port!r} is not a number") from None
    if not 0 <= number <= 65535:
        raise ConfigError(f"--{what}: port {number} is out of range")
    return host.strip("[]"), number


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate(config: ServeConfig) -> ServeConfig:
    """Check every setting; read the admin token. Returns the config with the token filled."""
    c = config
    if c.attach not in ATTACH_MODES:
        raise ConfigError(f"--attach must be owner, relay or http, got {c.attach!r}")
    check_bounds({f.name: getattr(c, f.name) for f in fields(c)})
    _check_engine_facing(c)
    _check_load_publisher(c)
    file_targets, http_token = _http_files(c)
    c.listen_host_port  # noqa: B018 - validates
    logging_values = _logging_values(c)
    try:
        event_loop = event_loop_value(c.event_loop)
    except ValueError as exc:
        raise ConfigError(f"{flag('event_loop')}: {exc}") from None
    resolve_event_loop(event_loop)  # uvloop asked for but not installed: one line, exit 2
    web = load_web_config(c.web_config_file) if c.web_config_file else None
    token = _admin_token(c)
    values = {f.name: getattr(c, f.name) for f in fields(c)}
    return ServeConfig(
        **{
            **values,
            **logging_values,
            "event_loop": event_loop,
            "admin_token": token,
            "web": web,
            "http_file_targets": file_targets,
            "http_token": http_token,
        }
    )


def _check_engine_facing(c: ServeConfig) -> None:
    """What each attach mode needs to reach its engines (ZMQ modes: addresses and ranks that fit;
    relay: its upstream; HTTP: a target)."""
    if c.attach in ("owner", "relay"):
        if c.engine_count < 1:
            raise ConfigError("--engine-count must be at least 1")
        if not c.handshake_address.startswith(("tcp://", "ipc://")):
            raise ConfigError("--handshake-address must be tcp://HOST:PORT or ipc://PATH")
        if c.start_rank + c.engine_count > 65536:
            raise ConfigError("--start-rank/--engine-count: engine indices must fit in 0..65535")
        # The input socket binds the base port, engine i's output base + 1 + i.
        if c.fixed_base_port is not None and c.fixed_base_port + c.engine_count > HIGHEST_PORT:
            raise ConfigError(
                f"--fixed-base-port {c.fixed_base_port} with --engine-count {c.engine_count} "
                f"needs ports up to {c.fixed_base_port + c.engine_count}; the highest is "
                f"{HIGHEST_PORT}"
            )
    if c.attach == "relay" and not c.upstream_handshake_address:
        raise ConfigError("--attach relay needs --upstream-handshake-address")
    if c.attach == "http" and not (c.http_target or c.http_targets_file):
        raise ConfigError("--attach http needs --http-target URL or --http-targets-file")


def _check_load_publisher(c: ServeConfig) -> None:
    """``--load-publisher tcp://HOST:BASE``: a host and a base port (rank r binds BASE + r);
    off loopback only when the host is given as such (a router on another host)."""
    if c.load_publisher is None:
        return
    text = c.load_publisher
    if not text.startswith("tcp://"):  # SGLang's routers dial TCP
        raise ConfigError(f"--load-publisher must be tcp://HOST:BASE, got {text[:80]!r}")
    where = c.load_publisher_host_port
    if where is not None and where[1] < 1:
        raise ConfigError("--load-publisher: the base port must be at least 1")


def _http_files(c: ServeConfig) -> tuple[tuple[str, ...], str | None]:
    """HTTP mode's targets file and bearer token, read once, here: a bad file is one line
    before anything starts."""
    if c.attach != "http":
        return (), None
    file_targets: tuple[str, ...] = ()
    if c.http_targets_file:
        file_targets = target_lines(read_text_file(c.http_targets_file, "--http-targets-file"))
    http_token = (
        read_token_file(c.http_token_file, "--http-token-file") if c.http_token_file else None
    )
    return file_targets, http_token


def _logging_values(c: ServeConfig) -> dict[str, Any]:
    values = {}
    for name, convert in (("log_level", log_level_value), ("log_format", log_format_value)):
        try:
            values[name] = convert(getattr(c, name))
        except ValueError as exc:
            raise ConfigError(f"{flag(name)}: {exc}") from None
    return values


def _admin_token(c: ServeConfig) -> str | None:
    """The admin token, read from its file; none off loopback is refused (security by default)."""
    admin = c.admin_host_port
    token = (
        read_token_file(c.admin_token_file, "--admin-token-file") if c.admin_token_file else None
    )
    if admin is not None and not is_loopback(admin[0]) and token is None:
        raise ConfigError(
            f"refusing to serve the admin endpoint on non-loopback address {admin[0]} without "
            "a token: set --admin-token-file, or bind --admin-listen to 127.0.0.1"
        )
    return token
