"""``--log-level`` / ``--log-format`` (docs/security.md, Logs) before and after every subcommand,
from the environment and (serve) the config file, unknown values refused; the admin audit is a
record of the same structured log (text or JSON), and the token is never in it."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from exporter.base.logs import (
    AUDIT_LOGGER,
    configure_logging,
    log_audit,
    logging_settings,
)
from exporter.base.ports import free_listen_port
from exporter.commands.cli import build_parser, main
from exporter.config.settings import resolve_config
from exporter.error import ConfigError
from tests.harness.processes import python_cmd, run_cli

COMMANDS = {
    "serve": ["serve"],
    "demo": ["demo"],
    "probe": ["probe", "--engine-count", "1", "--handshake-address", "tcp://127.0.0.1:1"],
    "sim-engine": ["sim-engine", "--handshake-address", "tcp://127.0.0.1:1"],
    "ctl": ["ctl", "status"],
}
OWNER = {"engine_count": 1, "handshake_address": "tcp://127.0.0.1:5555", "admin_listen": "off"}


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    audit_level = logging.getLogger(AUDIT_LOGGER).level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger(AUDIT_LOGGER).setLevel(audit_level)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_flags_before_and_after_every_subcommand(command: str) -> None:
    parser = build_parser()
    argv = COMMANDS[command]
    args = parser.parse_args(argv)
    assert args.log_level is None and args.log_format is None  # unset: env, then defaults
    args = parser.parse_args(["--log-level", "WARNING", "--log-format", "JSON", *argv])
    assert (args.log_level, args.log_format) == ("warning", "json")
    args = parser.parse_args([*argv, "--log-level", "Debug", "--log-format", "text"])
    assert (args.log_level, args.log_format) == ("debug", "text")
    # After the subcommand wins over before it.
    args = parser.parse_args(["--log-level", "error", *argv, "--log-level", "info"])
    assert args.log_level == "info"


def test_ctl_takes_them_before_its_own_subcommand_too() -> None:
    args = build_parser().parse_args(
        ["ctl", "--log-format", "json", "status", "--log-level", "error"]
    )
    assert (args.log_level, args.log_format) == ("error", "json")


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-level", "verbose", "ctl", "status"],
        ["ctl", "status", "--log-level", "verbose"],
        ["serve", "--log-format", "logfmt"],
        ["--log-format", "xml", "demo"],
        ["sim-engine", "--handshake-address", "tcp://x:1", "--log-level", "trace"],
    ],
)
def test_unknown_values_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_environment_fills_what_the_flags_leave() -> None:
    args = build_parser().parse_args(["ctl", "status"])
    env = {"VLLM_DP_EXPORTER_LOG_LEVEL": "ERROR", "VLLM_DP_EXPORTER_LOG_FORMAT": "Json"}
    assert logging_settings(args, env) == ("error", "json")
    assert logging_settings(args, {}) == ("info", "text")
    args = build_parser().parse_args(["ctl", "status", "--log-level", "debug"])
    assert logging_settings(args, env) == ("debug", "json")
    with pytest.raises(ValueError, match="VLLM_DP_EXPORTER_LOG_FORMAT: log format must be one of"):
        logging_settings(args, {"VLLM_DP_EXPORTER_LOG_FORMAT": "yaml"})


def test_a_bad_environment_value_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_DP_EXPORTER_LOG_LEVEL", "loud")
    assert main(["ctl", "status", "--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "vllm-dp-exporter ctl: VLLM_DP_EXPORTER_LOG_LEVEL: log level must be one of debug, "
        "info, warning, error, critical, got 'loud'"
    ]


def test_serve_settings_from_flags_environment_and_config_file(tmp_path: Path) -> None:
    config = resolve_config(None, environ={}, **OWNER)
    assert (config.log_level, config.log_format) == ("info", "text")
    env = {"VLLM_DP_EXPORTER_LOG_LEVEL": "warning", "VLLM_DP_EXPORTER_LOG_FORMAT": "JSON"}
    config = resolve_config(None, environ=env, **OWNER)
    assert (config.log_level, config.log_format) == ("warning", "json")
    file = tmp_path / "c.json"
    file.write_text(json.dumps({"log_level": "DEBUG", "log-format": "json"}))
    config = resolve_config(None, environ={}, config=str(file), **OWNER)
    assert (config.log_level, config.log_format) == ("debug", "json")
    config = resolve_config(None, environ=env, config=str(file), **OWNER)
    assert config.log_level == "warning"  # the environment beats the file
    args = build_parser().parse_args(["serve", "--log-level", "error", "--config", str(file)])
    assert resolve_config(args, environ=env, **OWNER).log_level == "error"  # the flag beats both
    file.write_text(json.dumps({"log_format": "logfmt"}))
    with pytest.raises(ConfigError, match="--log-format: log format must be one of text, json"):
        resolve_config(None, environ={}, config=str(file), **OWNER)
    with pytest.raises(ConfigError, match="VLLM_DP_EXPORTER_LOG_LEVEL='x' is not a valid"):
        resolve_config(None, environ={"VLLM_DP_EXPORTER_LOG_LEVEL": "x"}, **OWNER)


AUDIT = {
    "time": "2026-01-31T12:00:00Z",
    "event": "admin_request",
    "action": "reset_prefix_cache",
    "client": "127.0.0.1",
    "flags": {"reset_running_requests": True, "reset_connector": False},
    "outcome": "partial_failure",
    "failed_engines": [1],
    "status": 502,
    "duration_s": 0.0042,
}


def test_json_format_one_object_per_line(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("error", "json", out)  # the audit is logged whatever the level
    logging.getLogger("exporter.server").info("dropped at error level")
    logging.getLogger("exporter.server").error("two\nlines %s", "here")
    log_audit(AUDIT)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("exporter.admin").exception("admin request failed")
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    plain, audit, failed = (json.loads(line) for line in lines)
    assert plain["message"] == "two\nlines here" and plain["level"] == "ERROR"
    assert plain["logger"] == "exporter.server"
    assert time.strptime(plain["time"], "%Y-%m-%dT%H:%M:%S.%fZ")
    assert audit["logger"] == "exporter.audit" and audit["level"] == "INFO"
    assert audit["message"] == "admin request reset_prefix_cache 502 partial_failure"
    fields = {k: v for k, v in AUDIT.items() if k != "time"}
    assert {k: audit[k] for k in fields} == fields
    assert audit["time"] != AUDIT["time"]  # the line's time is the log record's
    assert "RuntimeError: boom" in failed["exception"]


def test_text_format_is_a_readable_line(restore_logging: None) -> None:
    out = io.StringIO()
    configure_logging("info", "text", out)
    logging.getLogger("exporter.server").info("serving")
    log_audit({**AUDIT, "client": "evil\x1b[31m host"})
    first, second = out.getvalue().splitlines()
    assert first.endswith(" INFO exporter.server: serving")
    assert " INFO exporter.audit: admin request reset_prefix_cache 502 partial_failure " in second
    assert "action=reset_prefix_cache" in second and "status=502" in second
    assert 'flags={"reset_connector":false,"reset_running_requests":true}' in second
    assert "failed_engines=[1]" in second
    assert 'client="evil\\u001b[31m host"' in second  # quoted, escaped: never raw
    assert "\x1b" not in out.getvalue()


@pytest.mark.slow
async def test_serve_logs_audit_records_in_text_and_never_the_token(tmp_path: Path) -> None:
    """A real ``serve`` (no engines: an authenticated reset answers 503) with the default text
    format: the audit is a line of the same log, and the token appears nowhere."""
    token = "never-log-this-token-5f3a"
    (tmp_path / "token").write_text(token)
    port, admin = free_listen_port(), free_listen_port()
    proc = await asyncio.create_subprocess_exec(
        *python_cmd(
            "serve",
            "--log-level",
            "DEBUG",
            "--engine-count",
            "1",
            "--handshake-address",
            f"tcp://127.0.0.1:{free_listen_port()}",
            "--listen",
            f"127.0.0.1:{port}",
            "--admin-listen",
            f"127.0.0.1:{admin}",
            "--admin-token-file",
            str(tmp_path / "token"),
        ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        url = f"http://127.0.0.1:{admin}/admin/reset_prefix_cache"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            for _ in range(100):
                try:
                    async with http.post(url, headers={"Authorization": "Bearer no"}) as resp:
                        assert resp.status == 401
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            auth = {"Authorization": f"Bearer {token}"}
            async with http.post(url, headers=auth) as resp:
                assert resp.status == 503
        proc.terminate()
        out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = err.decode()
    audits = [line for line in text.splitlines() if " exporter.audit: " in line]
    assert len(audits) == 2, text
    assert "outcome=unauthorized" in audits[0] and "status=401" in audits[0]
    assert "status=503" in audits[1] and "client=127.0.0.1" in audits[1]
    assert not any(line.startswith("{") for line in text.splitlines())  # no second format
    assert " DEBUG " in text
    # The serve command freezes its start-up heap once (exporter.runtime.freeze_startup_heap).
    assert re.search(r"heap frozen after start-up: [1-9]\d* objects", text), text
    assert token not in text and token not in out.decode()


@pytest.mark.slow
async def test_cli_rejects_a_bad_log_format_after_the_subcommand() -> None:
    code, out, err = await run_cli("probe", "--log-format", "fancy")
    assert code == 2 and out == ""
    assert "argument --log-format: invalid choice: 'fancy'" in err
