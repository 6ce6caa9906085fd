"""One structured log for every command: ``--log-level`` and ``--log-format text|json``.

* ``text``: ``2026-01-31 12:00:00,123 INFO exporter.server: message``, the readable default;
  the fields of a structured record (the admin audit) follow the message as ``key=value``
  (values that are not plain words are JSON-quoted, so a control character never reaches the
  terminal raw).
* ``json``: one JSON object per line: ``time`` (UTC, RFC 3339 with milliseconds), ``level``,
  ``logger``, ``message``, then the record's fields (and ``exception`` with a traceback).

The admin audit (``log_audit``) is a record of logger ``exporter.audit`` at INFO whose fields
are the audit's; that logger is always at INFO, so ``--log-level warning`` quiets the exporter
but never its audit trail. Nothing here ever sees the admin token: the audit record carries none.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from collections.abc import Mapping
from typing import IO, Any

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")
DEFAULT_LEVEL, DEFAULT_FORMAT = "info", "text"
ENV_LEVEL, ENV_FORMAT = "VLLM_DP_EXPORTER_LOG_LEVEL", "VLLM_DP_EXPORTER_LOG_FORMAT"
AUDIT_LOGGER = "exporter.audit"
#: ``extra=`` key of a record's structured fields.
FIELDS_ATTR = "fields"
RESERVED = ("time", "level", "logger", "message")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_PLAIN = re.compile(r"[A-Za-z0-9_.:/@+\-]+")

audit_log = logging.getLogger(AUDIT_LOGGER)


def _choice(kind: str, choices: tuple[str, ...]) -> Any:
    def convert(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in choices:
            raise ValueError(f"{kind} must be one of {', '.join(choices)}, got {text!r}")
        return lowered

    convert.__name__ = kind.replace(" ", "_")
    return convert


#: Converters of the environment / config-file values (any case), raising ValueError.
log_level_value = _choice("log level", LOG_LEVELS)
log_format_value = _choice("log format", LOG_FORMATS)


def add_logging_arguments(parser: argparse.ArgumentParser, *, top: bool = False) -> None:
    """``--log-level`` and ``--log-format`` on ``parser`` (a no-op when it has them already).

    On a subcommand (``top=False``) they default to ``argparse.SUPPRESS``: given after the
    subcommand they win, otherwise the value given before it (or None) stays."""
    if "--log-level" in parser._option_string_actions:
        return
    default = None if top else argparse.SUPPRESS
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.lower,
        choices=LOG_LEVELS,
        help=f"{', '.join(LOG_LEVELS)}, any case (default: {DEFAULT_LEVEL}; env {ENV_LEVEL})",
    )
    parser.add_argument(
        "--log-format",
        default=default,
        type=str.lower,
        choices=LOG_FORMATS,
        help=f"text or json (one JSON object per line), any case (default: {DEFAULT_FORMAT}; "
        f"env {ENV_FORMAT})",
    )


def add_logging_arguments_everywhere(parser: argparse.ArgumentParser) -> None:
    """``add_logging_arguments`` on ``parser`` and every subcommand below it, at any depth
    (``ctl status`` included), whoever added the subcommand."""
    add_logging_arguments(parser, top=True)
    stack = [parser]
    while stack:
        for action in stack.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    add_logging_arguments(sub)
                    stack.append(sub)


def logging_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str]:
    """(level, format): the flag, else the environment, else the default. ValueError (one
    line, naming the variable) for an environment value that is no choice."""
    out = []
    for attr, env_key, convert, default in (
        ("log_level", ENV_LEVEL, log_level_value, DEFAULT_LEVEL),
        ("log_format", ENV_FORMAT, log_format_value, DEFAULT_FORMAT),
    ):
        value = getattr(args, attr, None)
        if value is None and env_key in environ:
            try:
                value = convert(environ[env_key])
            except ValueError as exc:
                raise ValueError(f"{env_key}: {exc}") from None
        out.append(value or default)
    return out[0], out[1]


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTR, None)
    return dict(fields) if isinstance(fields, Mapping) else {}


def _text_value(value: Any) -> str:
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, default=str)


class TextFormatter(logging.Formatter):
    """The classic line, then the record's fields as ``key=value``."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = _fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (newlines in values are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        body: dict[str, Any] = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _fields(record).items():
            body[f"field_{key}" if key in RESERVED else key] = value
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            body["exception"] = record.exc_text
        if record.stack_info:
            body["stack"] = self.formatStack(record.stack_info)
        return json.dumps(body, default=str)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (as ``logging.lastResort``
    does), so a test that swaps stderr never leaves the handler holding a closed stream."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)

    @property
    def stream(self) -> IO[str]:
        return sys.stderr


def configure_logging(level: str, fmt: str = DEFAULT_FORMAT, stream: IO[str] | None = None) -> None:
    """One root handler on ``stream`` (stderr) in ``fmt``, replacing the one an earlier call
    installed (handlers installed by others, such as pytest's, stay); the audit logger stays at
    INFO whatever ``level`` is."""
    _own_handler(logging.getLogger(), level, fmt, stream)


def _own_handler(logger: logging.Logger, level: str, fmt: str, stream: IO[str] | None) -> None:
    """One handler of ours on ``logger`` in ``fmt`` (replacing the one an earlier call added),
    ``logger`` at ``level``, the audit logger at INFO."""
    for old in logger.handlers[:]:
        if getattr(old, "vllm_dp_exporter", False):
            logger.removeHandler(old)
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    setattr(handler, "vllm_dp_exporter", True)  # noqa: B010 - tags the handler as ours
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(getattr(logging, level.upper()))
    audit_log.setLevel(logging.INFO)


def configure_embedded_logging(
    level: str, fmt: str = DEFAULT_FORMAT, stream: IO[str] | None = None
) -> None:
    """Inside another program's process (vLLM's API server, whose ``vllm`` logger has its own
    handler and whose root logger has none): one handler on the ``exporter`` logger only, not
    propagated, so the exporter's warnings and the admin audit (INFO, whatever ``level``) reach
    stderr without touching the host's logging. Replaces the handler an earlier call added."""
    logger = logging.getLogger("exporter")
    _own_handler(logger, level, fmt, stream)
    logger.propagate = False


def log_audit(record: Mapping[str, Any]) -> None:
    """The default audit sink: one record of the structured log. Its ``time`` is the log
    record's own (when the answer was sent; ``duration_s`` gives the start)."""
    fields = {k: v for k, v in record.items() if k != "time"}
    summary = " ".join(
        str(record[k]) for k in ("action", "status", "outcome") if record.get(k) is not None
    )
    audit_log.info("admin request %s", summary, extra={FIELDS_ATTR: fields})
