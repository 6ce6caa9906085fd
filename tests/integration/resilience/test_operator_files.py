"""What an operator's files do at start: a config file nested too deeply is one line and exit 2
(never a RecursionError traceback), and a token file every user on the host can read is served
with one WARNING naming the file and its mode (never the token)."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from exporter.base.ports import free_listen_port
from exporter.commands.service import serve
from exporter.config.settings import resolve_config
from exporter.error import ConfigError
from tests.harness.waiting import eventually
from tests.integration.resilience.test_operator_input import OWNER, assert_one_line_exit_2, run_cli

TOKEN = "perm-test-token-4f1c"
DEEP = 100_000


def _deep_files(tmp_path: Path) -> list[Path]:
    """Config files whose nesting no recursive decoder survives, in each position."""
    files = {
        "top.json": "[" * DEEP,
        "value.json": '{"engine_count": 2, "model_name": ' + "[" * DEEP + "]" * DEEP + "}",
        "objects.json": '{"a": ' * DEEP,
        "array.toml": "model_name = " + "[" * DEEP + "]" * DEEP,
        "table.toml": "model_name = " + "{a = " * DEEP + "}" * DEEP,
    }
    # Just inside the JSON decoder's reach: decoded, then shown in the type error.
    files["shallow.json"] = '{"model_name": ' + "[" * 900 + "]" * 900 + "}"
    paths = []
    for name, text in files.items():
        path = tmp_path / name
        path.write_text(text)
        paths.append(path)
    return paths


def test_deeply_nested_config_files_are_one_line(tmp_path: Path) -> None:
    for path in _deep_files(tmp_path):
        with pytest.raises(ConfigError) as info:
            resolve_config(None, environ={}, config=str(path), **OWNER)
        text = str(info.value)
        assert "\n" not in text and str(path) in text, text
        assert len(text) < 300, text


@pytest.mark.slow
async def test_serve_with_a_deeply_nested_config_exits_2_with_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text('{"engine_count": ' + "[" * DEEP)
    deep_toml = tmp_path / "deep.toml"
    deep_toml.write_text("engine_count = " + "[" * DEEP + "]" * DEEP)
    results = await asyncio.gather(
        run_cli("serve", "--config", str(deep)), run_cli("serve", "--config", str(deep_toml))
    )
    assert_one_line_exit_2(results[0], str(deep), "nested")
    assert_one_line_exit_2(results[1], str(deep_toml), "nested")


def _token_file(tmp_path: Path, name: str, mode: int) -> str:
    path = tmp_path / name
    path.write_text(TOKEN + "\n")
    os.chmod(path, mode)
    return str(path)


async def _serve_briefly(caplog: pytest.LogCaptureFixture, **settings: object) -> list[str]:
    """``serve`` on loopback until it is listening; the WARNING lines it logged."""
    config = resolve_config(
        None,
        environ={},
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        **settings,
    )
    caplog.clear()
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    try:
        await eventually(
            lambda: (
                task.done() or any("serving /metrics" in r.getMessage() for r in caplog.records)
            ),
            what="serve listening",
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_token_file_every_user_can_read_is_warned_about_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    owner = {
        "attach": "owner",
        "engine_count": 1,
        "handshake_address": f"tcp://127.0.0.1:{free_listen_port()}",
    }
    loose = _token_file(tmp_path, "loose", 0o644)
    warnings = await _serve_briefly(caplog, **owner, admin_token_file=loose)
    mine = [w for w in warnings if "--admin-token-file" in w]
    assert len(mine) == 1, warnings
    assert loose in mine[0] and "0644" in mine[0]
    assert not any(TOKEN in r.getMessage() for r in caplog.records)
    # Owner-only and group-readable files (Kubernetes Secret volumes: 0440 with fsGroup) are
    # served without a warning.
    for name, mode in (("private", 0o600), ("group", 0o440)):
        path = _token_file(tmp_path, name, mode)
        owner["handshake_address"] = f"tcp://127.0.0.1:{free_listen_port()}"
        warnings = await _serve_briefly(caplog, **owner, admin_token_file=path)
        assert not [w for w in warnings if "token-file" in w], (mode, warnings)


async def test_an_http_token_file_every_user_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    loose = _token_file(tmp_path, "http-loose", 0o604)
    warnings = await _serve_briefly(
        caplog,
        attach="http",
        http_target=(f"http://127.0.0.1:{free_listen_port()}",),
        http_token_file=loose,
        poll_interval=60.0,
    )
    mine = [w for w in warnings if "--http-token-file" in w]
    assert len(mine) == 1 and loose in mine[0] and "0604" in mine[0], warnings
    assert not any(TOKEN in r.getMessage() for r in caplog.records)
