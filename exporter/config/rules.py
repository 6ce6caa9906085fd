"""The rules ``exporter.config`` applies to every setting, as tables and pure functions.

Every violation is a ``ConfigError`` whose one-line message names the setting (``--flag``, or
the config file's key) and what it must be; ``serve`` prints it and exits 2.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import stat
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from exporter.error import ConfigError

HOUR, DAY = 3600.0, 86400.0
HIGHEST_PORT = 65535


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- files ---------------------------------------------------------------------------------


#: The most an operator file (config, token, targets, basic-auth) may hold: read no further,
#: so a wrong path (a log, a huge file) is one error line, not a start that never ends.
MAX_TEXT_FILE_BYTES = 4 * 1024 * 1024

#: What a path that is not a regular file is, for the error line.
_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISSOCK, "a socket"),
)


def _open_regular(path: str, what: str) -> int:
    """A descriptor of ``path`` opened without blocking, checked on the descriptor itself (no
    stat-then-open race) to be a regular file: a FIFO would block the read until a writer
    came (for ever without one, or vLLM's event loop with it), a device would never end."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "something else")
        raise ConfigError(f"{what} {path} is not a regular file (it is {kind})")
    return fd


def check_regular_file(path: str, what: str) -> None:
    """``ConfigError`` unless ``path`` can be opened and is a regular file: for the files a
    library opens by path itself (``ssl``'s certificates and keys)."""
    os.close(_open_regular(path, what))


def no_passphrase(what: str) -> Callable[[], str]:
    """The ``password`` callback of ``ssl``'s ``load_cert_chain``: without one, OpenSSL asks
    for an encrypted key's passphrase on the terminal (a start or a ``ctl`` that waits for
    ever, or a prompt in a script); with it, one ``ConfigError`` line. Called only for an
    encrypted key."""

    def refuse() -> str:
        raise ConfigError(
            f"{what} is encrypted (passphrase-protected); a passphrase is never asked for: "
            "give a key without one (openssl pkey -in KEY -out PLAIN_KEY)"
        )

    return refuse


def read_text_file(path: str, what: str) -> str:
    """A regular file's text, strictly UTF-8, at most ``MAX_TEXT_FILE_BYTES``; ``what`` names
    it in the error (``config file``). Never blocks on a FIFO or reads a device."""
    fd = _open_regular(path, what)
    try:
        with os.fdopen(fd, "rb") as handle:
            raw = handle.read(MAX_TEXT_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TEXT_FILE_BYTES:
        raise ConfigError(f"{what} {path} is larger than {MAX_TEXT_FILE_BYTES // 2**20} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None


def read_token_file(path: str, what: str) -> str:
    """The token of a token file: its content without surrounding whitespace, one line."""
    token = read_text_file(path, what).strip()
    if not token:
        raise ConfigError(f"{what} {path} is empty")
    if any(c in token for c in "\r\n"):
        raise ConfigError(f"{what} {path} has several lines; it must hold only the token")
    return token


def open_to_everyone(path: str, what: str) -> str | None:
    """A warning when every user on the host may read (or write) a secret file, as ssh warns
    about keys; None otherwise. Group access is allowed: a Kubernetes Secret volume gives a
    non-root container its token as 0440 (root, the pod's fsGroup). Never reads the content."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None
    if not mode & (stat.S_IROTH | stat.S_IWOTH):
        return None
    return (
        f"{what} {path} is accessible to every user on this host (mode {mode:04o}); "
        "restrict it: chmod 600, or 640/440 for a group that needs it"
    )


# -- types (values from a config file, or given in code) -----------------------------------

_JSON_NAMES = {
    type(None): "null",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    str: "a string",
    list: "an array",
    dict: "a table/object",
}


def _shown(value: Any) -> str:
    kind = next((n for t, n in _JSON_NAMES.items() if type(value) is t), type(value).__name__)
    if value is None:
        return kind
    try:
        text = json.dumps(value, default=str)
    except (RecursionError, ValueError):  # a value nested nearly as deep as the decoder goes
        return f"{kind} nested too deeply"
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def split_targets(text: str) -> list[str]:
    """``http_target`` as one string: targets separated by commas or whitespace."""
    return [t for t in text.replace(",", " ").split() if t]


def check_type(what: str, value: Any, hint: Any) -> Any:
    """``value`` as the setting's type (``hint``, from the dataclass; ``what`` names the
    setting in the error): ints stay ints (never booleans), numbers become floats, ``X | None``
    also takes None (null), and a tuple of strings also takes one string."""
    args = typing.get_args(hint)
    optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)) and (type(None) in args)
    if optional:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            return tuple(split_targets(value))
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ConfigError(f"{what} must be a string or a list of strings, got {_shown(value)}")
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    wanted = {int: "an integer", float: "a number", str: "a string", bool: "a boolean"}.get(
        hint, str(hint)
    )
    if optional:
        wanted += " or null"
    raise ConfigError(f"{what} must be {wanted}, got {_shown(value)}")


# -- ranges ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bound:
    """A closed range unless an end is marked open; ``why`` is added to the message."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def holds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        low = f"{'greater than' if self.low_open else 'at least'} {self.low:g}"
        high = f"{'less than' if self.high_open else 'at most'} {self.high:g}"
        return f"{low} and {high}" + (f" ({self.why})" if self.why else "")


#: Every numeric setting; None values (unset optional settings) are not checked.
BOUNDS: dict[str, Bound] = {
    "engine_count": Bound(0, 65536),
    "start_rank": Bound(0, 65535),
    "fixed_base_port": Bound(1, HIGHEST_PORT),
    "relay_upstream_timeout": Bound(0, 300, low_open=True, why="engines wait 5 minutes"),
    "poll_interval": Bound(0, DAY, low_open=True),
    "call_timeout": Bound(0, HOUR, low_open=True),
    "poll_jitter": Bound(0, 1, high_open=True),
    "reset_min_interval": Bound(0, DAY),
    "reset_timeout": Bound(0, HOUR, low_open=True),
    "shutdown_grace": Bound(0, HOUR),
    "action_timeout": Bound(0, HOUR, low_open=True),
    "verify_weights_timeout": Bound(0, HOUR, low_open=True),
    "gate_min_interval": Bound(0, 60),
    "max_watchers": Bound(0, 1024),
    "hung_after": Bound(0, DAY),
    "stall_after": Bound(0, DAY),
    "engines_per_burst": Bound(0, 65536),
}


def check_bounds(values: Mapping[str, Any]) -> None:
    for name, bound in BOUNDS.items():
        value = values.get(name)
        if value is not None and not bound.holds(value):
            raise ConfigError(f"{flag(name)} must be {bound.describe()}, got {value!r}")


# -- the environment -----------------------------------------------------------------------


def unknown_env(environ: Mapping[str, str], prefix: str, known: Iterable[str]) -> list[str]:
    """One warning per ``PREFIX*`` variable that is not a setting (with a likely spelling)."""
    wanted = sorted(prefix + name.upper() for name in known)
    warnings = []
    for key in sorted(environ):
        if key.startswith(prefix) and key not in wanted:
            close = difflib.get_close_matches(key, wanted, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"ignoring unknown environment variable {key}{hint}")
    return warnings


def target_lines(text: str) -> tuple[str, ...]:
    """The entries of an HTTP targets file: one per line, blank lines and ``#`` comments
    ignored (pure)."""
    lines = (raw.split("#", 1)[0].strip() for raw in text.splitlines())
    return tuple(line for line in lines if line)
