"""Operator files that are not regular files are refused at once, with one line naming them.

A FIFO as a token, basic-auth, config, web config, targets or TLS file once blocked the read
until a writer came: ``ctl`` hung for ever, and the vLLM plugin blocked vLLM's event loop. A
character device (``/dev/zero``) is no file either. Every reader is tried here with a real
FIFO and a real device, each in a thread bounded by a timeout (a reader that blocks is released
by opening the FIFO for writing, and the test fails). The command lines (``serve``, ``ctl``)
run as subprocesses with a timeout; an encrypted client or server key makes them exit with one
line, never a passphrase prompt, also when they have a terminal to prompt on.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import shutil
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.config.settings import ServeConfig, resolve_config
from exporter.config.webconfig import load_web_config
from exporter.error import ConfigError
from exporter.inprocess.runtime import InProcessRuntime, plugin_config
from exporter.remote.credentials import Credentials
from tests.harness.processes import ROOT, clean_env, python_cmd

WAIT_S = 10.0
OWNER: dict[str, Any] = {
    "engine_count": 2,
    "handshake_address": "tcp://127.0.0.1:5555",
    "admin_listen": "off",
}
#: ``ctl reset-prefix-cache --admin-url``: its URL next.
CTL_RESET = ("ctl", "reset-prefix-cache", "--admin-url")
HTTP: dict[str, Any] = {"attach": "http", "http_target": ("http://127.0.0.1:1",), **OWNER}


def release(path: Path) -> None:
    """A reader blocked opening the FIFO at ``path`` gets its (empty) file: open and close
    the writing end. Nothing when no reader waits."""
    with contextlib.suppress(OSError):
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.fixture(params=["fifo", "device"])
def not_a_file(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A FIFO (no writer) or a character device that never ends."""
    if request.param == "device":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        yield Path("/dev/zero")
        return
    path = tmp_path / "pipe"
    os.mkfifo(path)
    yield path
    release(path)


def refused_at_once(read: Callable[[], object], path: Path) -> str:
    """The one-line ``ConfigError`` ``read`` raised, run in a thread bounded by WAIT_S."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(read())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(WAIT_S)
    if thread.is_alive():
        if path.is_fifo():
            release(path)
        thread.join(WAIT_S)
        pytest.fail(f"the read of {path} blocked for {WAIT_S}s")
    (result,) = outcome
    assert isinstance(result, ConfigError), repr(result)
    text = str(result)
    assert "\n" not in text and str(path) in text, text
    assert "is not a regular file" in text, text
    return text


def web_config_naming(tmp_path: Path, key: str, path: Path) -> str:
    """A web config whose TLS ``key`` (cert_file, key_file) is ``path``."""
    cert = tmp_path / "unused.pem"
    cert.write_text("not read\n")
    files = {"cert_file": str(cert), "key_file": str(cert), key: str(path)}
    lines = ["tls_server_config:", *(f"  {k}: {v}" for k, v in files.items())]
    web = tmp_path / f"web-{key}.yml"
    web.write_text("\n".join(lines) + "\n")
    return str(web)


def test_every_operator_file_kind_refuses_what_is_not_a_regular_file(
    not_a_file: Path, tmp_path: Path
) -> None:
    path = str(not_a_file)
    readers: dict[str, Callable[[], object]] = {
        "config file": lambda: resolve_config(None, environ={}, config=path, **OWNER),
        "--admin-token-file": lambda: resolve_config(
            None, environ={}, admin_token_file=path, **OWNER
        ),
        "--http-token-file": lambda: resolve_config(None, environ={}, http_token_file=path, **HTTP),
        "--http-targets-file": lambda: resolve_config(
            None, environ={}, http_targets_file=path, **{**HTTP, "http_target": None}
        ),
        "web config file": lambda: load_web_config(path),
        "web config cert_file": lambda: load_web_config(
            web_config_naming(tmp_path, "cert_file", not_a_file)
        ),
        "web config key_file": lambda: load_web_config(
            web_config_naming(tmp_path, "key_file", not_a_file)
        ),
        "ctl --token-file": lambda: Credentials.load(token_file=path),
        "ctl --basic-auth-file": lambda: Credentials.load(basic_auth_file=path),
        "ctl --ca-file": lambda: Credentials(ca_file=path).ssl_context(),
        "ctl --cert-file": lambda: Credentials(cert_file=path).ssl_context(),
        "plugin token file": lambda: plugin_config({"VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE": path}),
        "plugin config file": lambda: plugin_config({"VLLM_DP_EXPORTER_CONFIG": path}),
    }
    for what, read in readers.items():
        text = refused_at_once(read, not_a_file)
        kind = "a FIFO" if not_a_file.is_fifo() else "a character device"
        assert kind in text, (what, text)


async def test_the_plugin_refuses_a_fifo_token_file_and_vllm_serves_on(tmp_path: Path) -> None:
    """The plugin's start (in vLLM's event loop) with a FIFO as its token file: the start
    fails at once with the reason its routes answer, and never stalls the loop."""
    fifo = tmp_path / "token-pipe"
    os.mkfifo(fifo)
    runtime = InProcessRuntime({"VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE": str(fifo)})
    done = threading.Event()

    def start() -> None:  # a loop of its own: a blocked read must not hang this test's loop
        try:
            asyncio.run(runtime.start(object(), None))
        finally:
            done.set()

    threading.Thread(target=start, daemon=True).start()
    if not await asyncio.to_thread(done.wait, WAIT_S):
        release(fifo)
        pytest.fail("the plugin's start blocked on a FIFO token file")
    assert runtime.exporter is None and runtime.problem is not None
    assert str(fifo) in runtime.problem and "not a regular file" in runtime.problem
    assert "\n" not in runtime.problem


async def test_the_plugin_reads_its_settings_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settings read that takes its time (a slow file system) leaves vLLM's loop running:
    the read waits for a tick of the loop, which only comes if the read is off it."""
    token = tmp_path / "token"
    token.write_text("tok-off-the-loop-1\n")
    ticked = threading.Event()
    read_on_time: list[bool] = []

    def slow_plugin_config(environ: Any = None) -> ServeConfig:
        read_on_time.append(ticked.wait(WAIT_S / 2))
        raise ConfigError("stop here: the settings were read")

    async def tick() -> None:
        await asyncio.sleep(0)
        ticked.set()

    monkeypatch.setattr("exporter.inprocess.runtime.plugin_config", slow_plugin_config)
    runtime = InProcessRuntime({"VLLM_DP_EXPORTER_ADMIN_TOKEN_FILE": str(token)})
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(runtime.start(object(), None), tick()), WAIT_S)
    assert read_on_time == [True], f"the loop stood still for {time.monotonic() - started:.1f}s"
    assert runtime.problem is not None and "stop here" in runtime.problem


# -- the command lines ------------------------------------------------------------------------


def run_cli(*args: str, terminal: bool = False) -> tuple[int, str, str, bytes]:
    """``python -m exporter ARGS`` with stdin closed and no controlling terminal, or
    (``terminal``) on a pseudo-terminal of its own, where OpenSSL would ask for a passphrase;
    bounded by WAIT_S (killed after). Exit code, stdout, stderr, what reached the terminal."""
    master, slave = pty.openpty() if terminal else (-1, -1)

    def take_terminal() -> None:  # after setsid: the pty becomes the controlling terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    try:
        proc = subprocess.Popen(
            python_cmd(*args),
            stdin=slave if terminal else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=clean_env(),
            start_new_session=True,
            preexec_fn=take_terminal if terminal else None,
        )
        try:
            out, err = proc.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            shown = _drain(master) if terminal else b""
            pytest.fail(f"{args[:2]} still running after {WAIT_S}s; terminal: {shown!r}")
        return proc.returncode, out.decode(), err.decode(), _drain(master) if terminal else b""
    finally:
        for fd in (master, slave):
            if fd >= 0:
                os.close(fd)


def _drain(master: int) -> bytes:
    os.set_blocking(master, False)
    chunks = []
    with contextlib.suppress(OSError):  # EAGAIN: nothing more; EIO: the child closed it
        while chunk := os.read(master, 4096):
            chunks.append(chunk)
    return b"".join(chunks)


def one_line(result: tuple[int, str, str, bytes], code: int, *words: str) -> str:
    status, out, err, terminal = result
    assert status == code and out == "", result
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert all(w in lines[0] for w in words), (words, lines[0])
    assert b"pass phrase" not in terminal.lower(), terminal
    return lines[0]


def serve_args() -> list[str]:
    port = free_listen_port()
    return [
        "serve",
        "--engine-count",
        "2",
        "--handshake-address",
        f"tcp://127.0.0.1:{port}",
        "--admin-listen",
        "off",
    ]


@pytest.mark.slow
def test_the_command_lines_refuse_a_fifo_at_once(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    try:
        cases = [
            ([*serve_args(), "--admin-token-file", str(fifo)], 2),
            ([*CTL_RESET, "http://127.0.0.1:1", "--token-file", str(fifo)], 1),
            (["ctl", "status", "--url", "http://127.0.0.1:1", "--basic-auth-file", str(fifo)], 1),
        ]
        for args, code in cases:
            one_line(run_cli(*args), code, str(fifo), "not a regular file")
    finally:
        release(fifo)


def _encrypted_key_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate and its key, encrypted with a passphrase (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "ec"),
            *("-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"),
            *("-passout", "pass:secret-passphrase"),
        ],
        check=True,
        capture_output=True,
        timeout=WAIT_S,
        stdin=subprocess.DEVNULL,
    )
    assert b"ENCRYPTED" in key.read_bytes()
    return cert, key


@pytest.mark.slow
@pytest.mark.parametrize("terminal", [False, True], ids=["no-terminal", "terminal"])
def test_an_encrypted_key_is_one_line_never_a_prompt(tmp_path: Path, terminal: bool) -> None:
    cert, key = _encrypted_key_pair(tmp_path)
    ctl = run_cli(
        *CTL_RESET,
        "https://127.0.0.1:1",
        *("--cert-file", str(cert), "--key-file", str(key)),
        terminal=terminal,
    )
    one_line(ctl, 1, str(key), "passphrase")
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    serve = run_cli(*serve_args(), "--web-config-file", str(web), terminal=terminal)
    one_line(serve, 2, str(key), "passphrase")
