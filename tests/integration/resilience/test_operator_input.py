"""docs/reliability.md, rows A17 to A21, A24 and A27, A28: what an operator types (flags,
environment, config and token files) is checked with one clear line, start-up bind failures
are one line too, and ``ctl`` never prints a peer's control characters raw.

The CLI cases run ``python -m exporter`` as subprocesses, several at once (each needs ~0.7 s
of CPU to start); the rules themselves are checked in-process."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from exporter.base.ports import free_listen_port, free_port_range
from exporter.commands.cli import build_parser
from exporter.commands.ctl import clean, format_reset, format_status
from exporter.commands.service import run_serve
from exporter.config.settings import add_serve_arguments, env_warnings, resolve_config
from exporter.error import ConfigError
from tests.harness.processes import PYTHON, ROOT, can_bind

OWNER = {"engine_count": 2, "handshake_address": "tcp://127.0.0.1:5555", "admin_listen": "off"}


def flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


def one_line_error(base: dict[str, Any] = OWNER, **settings: Any) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_config(None, environ={}, **{**base, **settings})
    text = str(info.value)
    assert "\n" not in text and text, text
    return text


async def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_EXPORTER_")}
    proc = await asyncio.create_subprocess_exec(
        PYTHON,
        "-m",
        "exporter",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env={**environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 20)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def assert_one_line_exit_2(result: tuple[int, str, str], *words: str) -> None:
    code, out, err = result
    assert code == 2 and out == "", result
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("vllm-dp-exporter serve: "), err
    assert all(w in lines[0] for w in words), (words, err)


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port with a listener on it for the length of the test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- A17: unsafe numbers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "flag"),
    [
        ({"call_timeout": math.nan}, "--call-timeout"),
        ({"call_timeout": math.inf}, "--call-timeout"),
        ({"reset_timeout": -5}, "--reset-timeout"),
        ({"reset_timeout": math.nan}, "--reset-timeout"),
        ({"reset_min_interval": math.nan}, "--reset-min-interval"),
        ({"reset_min_interval": -1}, "--reset-min-interval"),
        ({"fixed_base_port": -5}, "--fixed-base-port"),
        ({"fixed_base_port": 0}, "--fixed-base-port"),
        ({"fixed_base_port": 70000}, "--fixed-base-port"),
        ({"fixed_base_port": 65535}, "--fixed-base-port"),  # base + 2 engines > 65535
        ({"fixed_base_port": 65534}, "--fixed-base-port"),
        ({"shutdown_grace": -1}, "--shutdown-grace"),
        ({"shutdown_grace": math.nan}, "--shutdown-grace"),
        ({"poll_interval": math.inf}, "--poll-interval"),
        ({"poll_interval": math.nan}, "--poll-interval"),
        ({"poll_jitter": math.nan}, "--poll-jitter"),
        ({"relay_upstream_timeout": math.nan}, "--relay-upstream-timeout"),
        ({"start_rank": -1}, "--start-rank"),
        ({"hung_after": -1}, "--hung-after"),
        ({"hung_after": math.nan}, "--hung-after"),
        ({"hung_after": math.inf}, "--hung-after"),
        ({"hung_after": 10**9}, "--hung-after"),
        ({"hung_after": "soon"}, "--hung-after"),
    ],
)
def test_unsafe_numbers_are_refused(settings: dict[str, Any], flag: str) -> None:
    assert flag in one_line_error(**settings)


def test_from_flags_and_the_environment() -> None:
    for argv in (
        ["--call-timeout", "nan"],
        ["--fixed-base-port", "-5"],
        ["--poll-interval", "inf"],
    ):
        with pytest.raises(ConfigError, match=argv[0]):
            resolve_config(flags(*argv), environ={}, **OWNER)
    with pytest.raises(ConfigError, match="--reset-min-interval"):
        resolve_config(None, environ={"VLLM_DP_EXPORTER_RESET_MIN_INTERVAL": "nan"}, **OWNER)
    # The edges that are fine stay fine.
    c = resolve_config(None, environ={}, **{**OWNER, "fixed_base_port": 65533})
    assert c.fixed_base_port == 65533
    c = resolve_config(None, environ={}, **OWNER, reset_min_interval=0, shutdown_grace=0)
    assert (c.reset_min_interval, c.shutdown_grace) == (0.0, 0.0)


# -- A18 to A21: config and token files ------------------------------------------------------


def _file(tmp_path: Path, name: str, content: Any) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(json.dumps(content))
    return str(path)


@pytest.mark.parametrize(
    ("setting", "value", "wanted"),
    [
        ("engine_count", "2", "an integer"),
        ("engine_count", 2.5, "an integer"),
        ("engine_count", True, "an integer"),
        ("listen", 19511, "a string"),
        ("admin_listen", None, "a string"),
        ("poll_interval", "5", "a number"),
        ("fixed_base_port", [1], "an integer or null"),
        ("http_target", 5, "a string or a list of strings"),
        ("http_target", ["http://a:1", 2], "a string or a list of strings"),
    ],
)
def test_wrong_types_in_the_config_file(
    tmp_path: Path, setting: str, value: Any, wanted: str
) -> None:
    path = _file(tmp_path, "c.json", {**OWNER, setting: value})
    text = one_line_error({}, config=path)
    assert f"{path}: {setting} must be {wanted}" in text, text


def test_http_target_string_or_list(tmp_path: Path) -> None:
    one = _file(tmp_path, "one.json", {"attach": "http", "http_target": "http://10.0.0.1:8000"})
    c = resolve_config(None, environ={}, config=one, admin_listen="off")
    assert c.http_target == ("http://10.0.0.1:8000",)
    two = _file(
        tmp_path, "two.json", {"attach": "http", "http_target": ["a=http://h:1", "b=http://h:2"]}
    )
    c = resolve_config(None, environ={}, config=two, admin_listen="off")
    assert c.http_target == ("a=http://h:1", "b=http://h:2")
    # Null for an optional setting is its default.
    nulls = _file(tmp_path, "n.json", {**OWNER, "fixed_base_port": None, "model_name": None})
    assert resolve_config(None, environ={}, config=nulls).fixed_base_port is None


def test_files_that_are_not_utf8_or_hold_several_lines(tmp_path: Path) -> None:
    latin1 = _file(tmp_path, "c.json", '{"model_name": "caf\xe9"}'.encode("latin-1"))
    assert "not UTF-8" in one_line_error(config=latin1)
    token = _file(tmp_path, "t1", b"tok\xff\xfeen\n")
    assert "not UTF-8" in one_line_error(admin_token_file=token)
    token = _file(tmp_path, "t2", b"first-token\nsecond-token\n")
    assert "several lines" in one_line_error(admin_token_file=token)
    token = _file(tmp_path, "t3", b"\n  the-token  \r\n")  # surrounding whitespace is fine
    c = resolve_config(None, environ={}, **OWNER, admin_token_file=token)
    assert c.admin_token == "the-token"
    http: dict[str, Any] = {"attach": "http", "http_target": ("http://h:1",)}
    assert "not UTF-8" in one_line_error(**http, http_token_file=_file(tmp_path, "h", b"\xff"))
    assert "several lines" in one_line_error(**http, http_token_file=_file(tmp_path, "h2", b"a\nb"))


@pytest.mark.slow
async def test_cli_errors_are_one_line_exit_2(tmp_path: Path, busy_port: int) -> None:
    """End to end, as an operator sees it: the process prints one line and exits 2."""
    hs = f"tcp://127.0.0.1:{free_listen_port()}"
    typed = _file(tmp_path, "c.json", {"engine_count": "2", "handshake_address": hs})
    results = await asyncio.gather(
        run_cli("serve", "--config", typed),
        run_cli(
            "serve", "--engine-count", "2", "--handshake-address", hs,
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
            "--fixed-base-port", str(busy_port),
        ),
    )  # fmt: skip
    assert_one_line_exit_2(results[0], "engine_count must be an integer", "string")
    assert_one_line_exit_2(results[1], "engine-facing sockets", f":{busy_port}", "in use")


def serve_in_process(
    argv: list[str], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> tuple[int, str, str]:
    """``run_serve`` on parsed flags, in this process (no interpreter start-up per case)."""
    caplog.clear()
    code = run_serve(build_parser().parse_args(argv))
    captured = capsys.readouterr()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    return code, captured.out, captured.err


def test_config_and_bind_errors_at_start_up(
    tmp_path: Path,
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in [k for k in os.environ if k.startswith("VLLM_DP_EXPORTER_")]:
        monkeypatch.delenv(key)

    def serve(*extra: str) -> tuple[int, str, str]:
        hs = f"tcp://127.0.0.1:{free_listen_port()}"
        argv = [
            "serve", "--engine-count", "2", "--handshake-address", hs,
            "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", *extra,
        ]  # fmt: skip
        return serve_in_process(argv, capsys, caplog)

    busy = f"127.0.0.1:{busy_port}"
    assert_one_line_exit_2(serve("--listen", busy), f"--listen {busy}", "in use")
    # A documentation address (TEST-NET-1): never on this host, and no DNS lookup involved.
    assert_one_line_exit_2(serve("--listen", "192.0.2.1:0"), "--listen 192.0.2.1:0", "assign")
    assert_one_line_exit_2(serve("--admin-listen", busy), f"--admin-listen {busy}", "in use")
    assert_one_line_exit_2(
        serve("--advertise-host", "no-such-interface.invalid"),
        "engine-facing sockets",
        "no-such-interface.invalid",
    )
    assert_one_line_exit_2(
        serve("--handshake-address", f"tcp://{busy}"), "engine-facing sockets", busy
    )
    assert_one_line_exit_2(
        serve("--fixed-base-port", "65535"), "--fixed-base-port 65535", "--engine-count 2"
    )
    assert_one_line_exit_2(serve("--call-timeout", "nan"), "--call-timeout", "nan")
    token = _file(tmp_path, "token", b"\xff\xfe")
    assert_one_line_exit_2(serve("--admin-token-file", token), "--admin-token-file", "UTF-8")
    # What was bound before the failing socket is released: engine-facing sockets on fixed
    # ports and the admin listener, when the metrics listener cannot be bound.
    base, admin = free_port_range(3), free_listen_port()
    code, _, _ = serve(
        "--fixed-base-port", str(base), "--admin-listen", f"127.0.0.1:{admin}", "--listen", busy
    )
    assert code == 2
    assert all(can_bind(port) for port in (base, base + 1, base + 2, admin))


# -- A24: ctl never prints control characters from the answers ------------------------------

EVIL = "0.33\x1b[2J\x1b[31mPWNED\x1b[0m\r\n7  awake  up  ok  0.33.0  -\u202e\x07"


def _status_body() -> dict[str, Any]:
    sleeping = {"value": None, "outcome": "ok", "error": EVIL, "values": None}
    engine = {"engine": 0, "state": "awake", "up": True, "invariants": {"is_sleeping": sleeping}}
    return {
        "engines_connected": 1,
        "engines_expected": 1,
        "last_poll": {"number": 3},
        "aggregate": {
            "is_sleeping": {"state": "unknown", "value": None, "error": EVIL},
            "is_scheduler_paused": {"state": "unknown", "value": None},
        },
        "engines": [{**engine, "vllm_version": EVIL}],
    }


def _reset_body() -> dict[str, Any]:
    failed = {"engine": EVIL, "ok": False, "reason": "failed", "error": EVIL}
    return {
        "success": False,
        "outcome": "partial_failure",
        "engines": [{"engine": 0, "ok": True, "reason": None, "error": None}, failed],
        "failed_engines": [EVIL],
        "error": EVIL,
    }


@pytest.fixture
async def hostile_exporter() -> AsyncIterator[str]:
    """An HTTP server answering /status and the admin reset with control characters."""

    async def status(request: web.Request) -> web.Response:
        return web.json_response(_status_body())

    async def reset(request: web.Request) -> web.Response:
        return web.json_response(_reset_body(), status=502)

    async def refused(request: web.Request) -> web.Response:
        return web.json_response({"error": EVIL}, status=400)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_post("/admin/reset_prefix_cache", reset)
    app.router.add_post("/refusing/admin/reset_prefix_cache", refused)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.slow
async def test_ctl_escapes_control_characters(hostile_exporter: str) -> None:
    url = hostile_exporter
    (s_code, s_out, s_err), (r_code, r_out, r_err), (e_code, e_out, e_err) = await asyncio.gather(
        run_cli("ctl", "status", "--url", url),
        run_cli("ctl", "reset-prefix-cache", "--admin-url", url),
        run_cli("ctl", "reset-prefix-cache", "--admin-url", url + "/refusing"),
    )
    assert (s_code, r_code, e_code) == (2, 2, 1), (s_err, r_err, e_err)
    for text in (s_out, s_err, r_out, r_err, e_out, e_err):
        assert not any(c in text for c in "\x1b\r\x07\u202e"), repr(text)
    # Nothing starts a fake row: verdict, aggregate error, header, one row per engine.
    assert len(s_out.splitlines()) == 4, s_out
    assert len(r_out.splitlines()) == 4, r_out  # head, header, two engines
    assert "\\x1b[2J" in s_out and "\\r\\n7  awake" in s_out
    assert "\\x1b[31mPWNED" in e_err and len(e_err.splitlines()) == 1


def test_clean_and_the_tables() -> None:
    assert clean("0.33.0") == "0.33.0"
    assert (
        clean("a\x1b[2Jb\n\tc\x7f\x9b\u2028\u202ed") == "a\\x1b[2Jb\\n\\tc\\x7f\\x9b\\u2028\\u202ed"
    )
    assert clean("llama-3 ünïcode ✓") == "llama-3 ünïcode ✓"
    for text in (format_status(_status_body()), format_reset(_reset_body())):
        assert all(line.isprintable() for line in text.split("\n")), repr(text)


# -- A27, A28: misspelled environment variables, bogus log levels -----------------------------


def test_unknown_environment_variables_are_named() -> None:
    env = {
        "VLLM_DP_EXPORTER_POLL_INTERVALL": "2",
        "VLLM_DP_EXPORTER_POLL_INTERVAL": "2",
        "VLLM_DP_EXPORTER_CONFIG": "/dev/null",
        "VLLM_DP_EXPORTER_ADMIN_TOKEN": "x",
        "PATH": "/bin",
    }
    warnings = env_warnings(env)
    assert len(warnings) == 2, warnings
    assert "VLLM_DP_EXPORTER_ADMIN_TOKEN" in warnings[0]
    assert "VLLM_DP_EXPORTER_POLL_INTERVALL" in warnings[1]
    assert "did you mean VLLM_DP_EXPORTER_POLL_INTERVAL?" in warnings[1]
    assert env_warnings({"VLLM_DP_EXPORTER_LISTEN": "x"}) == []


def test_log_level_is_one_of_the_levels(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for given, level in (("WARNING", "warning"), ("debug", "debug"), ("Error", "error")):
        assert parser.parse_args(["--log-level", given, "ctl", "status"]).log_level == level
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--log-level", "verbose", "ctl", "status"])
    assert info.value.code == 2
    assert "invalid choice: 'verbose'" in capsys.readouterr().err


@pytest.mark.slow
async def test_serve_warns_about_a_misspelled_variable() -> None:
    code, out, err = await run_cli(
        "serve",
        "--engine-count",
        "0",
        env={"VLLM_DP_EXPORTER_CALL_TIMOUT": "5"},
    )
    assert code == 2 and out == ""
    warning, error = err.splitlines()
    assert warning == (
        "vllm-dp-exporter serve: warning: ignoring unknown environment variable "
        "VLLM_DP_EXPORTER_CALL_TIMOUT; did you mean VLLM_DP_EXPORTER_CALL_TIMEOUT?"
    )
    assert "--engine-count" in error or "--handshake-address" in error
