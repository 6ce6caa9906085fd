"""``--web-config-file`` (exporter-toolkit's web configuration format, docs/security.md) with a
real TLS client: TLS scrapes, plain HTTP refused, client certificates, basic auth on /metrics,
/status, /gate and / (not /healthz and /readyz), the admin listener over TLS with its bearer
token, and a one-line error for every kind of bad file."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from exporter.base.ports import free_listen_port
from exporter.commands.service import serve
from exporter.config.settings import ServeConfig, resolve_config
from exporter.config.webconfig import load_web_config
from exporter.error import ConfigError
from exporter.web.basicauth import BasicAuthChecker
from tests.harness import artefacts
from tests.harness.processes import run_cli
from tests.harness.tls import PASSWORD, USER, Pki, bcrypt_hash, make_pki, write_web_config

TOKEN = "admin-token-0123456789abcdef"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def web_config(pki: Pki, name: str, **kwargs: Any) -> str:
    return str(write_web_config(pki.dir / f"{name}.yml", pki, **kwargs))


def config_for(web_config_file: str, tmp_path: Path, *, token: bool = True) -> ServeConfig:
    settings: dict[str, Any] = {
        "engine_count": 1,
        "handshake_address": f"tcp://127.0.0.1:{free_listen_port()}",
        "listen": f"127.0.0.1:{free_listen_port()}",
        "admin_listen": f"127.0.0.1:{free_listen_port()}",
        "web_config_file": web_config_file,
        "poll_interval": 0.2,
    }
    if token:
        (tmp_path / "token").write_text(TOKEN)
        settings["admin_token_file"] = str(tmp_path / "token")
    return resolve_config(None, environ={}, **settings)


@contextlib.asynccontextmanager
async def serving(config: ServeConfig) -> AsyncIterator[tuple[str, str]]:
    """``serve(config)`` in this event loop; yields the https URLs of both listeners."""
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config, stop))
    host, port = config.listen_host_port
    admin = config.admin_host_port
    assert admin is not None
    try:
        for _ in range(200):
            assert not task.done(), task.exception()
            try:
                _, writer = await asyncio.open_connection(admin[0], admin[1])
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            break
        yield f"https://{host}:{port}", f"https://{admin[0]}:{admin[1]}"
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


async def get(
    url: str, ctx: ssl.SSLContext | bool, source: str | None = None, **kwargs: Any
) -> tuple[int, str, Any]:
    """One GET; ``source``: the loopback address to send it from."""
    connector = aiohttp.TCPConnector(local_addr=(source, 0)) if source else None
    async with (
        aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.get(url, ssl=ctx, **kwargs) as resp,
    ):
        return resp.status, await resp.text(), resp.headers


async def post(url: str, ctx: ssl.SSLContext | bool, **kwargs: Any) -> tuple[int, str, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
        http.post(url, ssl=ctx, **kwargs) as resp,
    ):
        return resp.status, await resp.text(), resp.headers


def tls12_handshake(host: str, port: int, ctx: ssl.SSLContext) -> None:
    """A raw TLS 1.2 handshake (TLS 1.2 checks the client certificate inside the handshake)."""
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    with (
        socket.create_connection((host, port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert tls.recv(100).startswith(b"HTTP/1.1 200")


@pytest.mark.slow
async def test_tls_scrape_and_plain_http_refused(pki: Pki, tmp_path: Path) -> None:
    path = web_config(pki, "tls-only", extra_tls="min_version: TLS12")
    config = config_for(path, tmp_path)
    assert config.web is not None and config.web.scheme == "https"
    async with serving(config) as (url, _):
        status, body, _ = await get(url + "/metrics", pki.client_context())
        assert status == 200 and "vllm_dp_engines_expected" in body
        status, body, _ = await get(url + "/status", pki.client_context())
        assert status == 200 and '"engines"' in body
        # A client that does not trust the CA refuses the server.
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(url + "/metrics", True)
        # Plain HTTP on the TLS listener gets no HTTP answer at all.
        plain = url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):
            await get(plain + "/metrics", False)


@pytest.mark.slow
async def test_min_version_tls13_refuses_a_tls12_client(pki: Pki, tmp_path: Path) -> None:
    config = config_for(web_config(pki, "tls13", extra_tls="min_version: TLS13"), tmp_path)
    async with serving(config) as (url, _):
        assert (await get(url + "/healthz", pki.client_context()))[0] == 200
        host, port = config.listen_host_port
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(tls12_handshake, host, port, pki.client_context())


@pytest.mark.slow
async def test_client_certificate_required(pki: Pki, tmp_path: Path) -> None:
    path = web_config(pki, "mtls", client_auth_type="RequireAndVerifyClientCert")
    config = config_for(path, tmp_path)
    assert config.web is not None and config.web.client_auth_type == "RequireAndVerifyClientCert"
    async with serving(config) as (url, admin):
        host, port = config.listen_host_port
        # Missing certificate: the TLS 1.2 handshake itself fails ...
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(tls12_handshake, host, port, pki.client_context())
        # ... a certificate from another CA too ...
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(tls12_handshake, host, port, pki.client_context(rogue=True))
        # ... and over TLS 1.3 no request gets an answer.
        with pytest.raises(aiohttp.ClientError):
            await get(url + "/metrics", pki.client_context())
        await asyncio.to_thread(tls12_handshake, host, port, pki.client_context(with_cert=True))
        status, body, _ = await get(url + "/metrics", pki.client_context(with_cert=True))
        assert status == 200 and "vllm_dp_" in body
        # The admin listener takes the same TLS settings.
        with pytest.raises(aiohttp.ClientError):
            await post(admin + "/admin/reset_prefix_cache", pki.client_context())


@pytest.mark.slow
async def test_verify_client_cert_if_given(pki: Pki, tmp_path: Path) -> None:
    path = web_config(pki, "mtls-optional", client_auth_type="VerifyClientCertIfGiven")
    config = config_for(path, tmp_path)
    async with serving(config) as (url, _):
        host, port = config.listen_host_port
        assert (await get(url + "/metrics", pki.client_context()))[0] == 200
        assert (await get(url + "/metrics", pki.client_context(with_cert=True)))[0] == 200
        with pytest.raises(ssl.SSLError):
            await asyncio.to_thread(tls12_handshake, host, port, pki.client_context(rogue=True))


@pytest.mark.slow
async def test_basic_auth_on_every_path_but_the_probes(pki: Pki, tmp_path: Path) -> None:
    path = web_config(
        pki,
        "basic",
        users={USER: PASSWORD, "other": "pw2"},
    )
    config = config_for(path, tmp_path)
    ctx = pki.client_context()
    async with serving(config) as (url, _):
        for i, route in enumerate(("/metrics", "/status", "/gate", "/", "/nope")):
            source = f"127.0.0.{11 + i}"  # each within its failed-attempt budget
            for headers in ({}, basic(USER, "wrong"), basic("nobody", PASSWORD), basic(USER, "")):
                status, _, h = await get(url + route, ctx, source, headers=headers)
                assert status == 401, (route, headers)
                assert h["WWW-Authenticate"].startswith('Basic realm="vllm-dp-exporter"')
            for headers in ({"Authorization": "Basic !!!"}, {"Authorization": f"Bearer {TOKEN}"}):
                assert (await get(url + route, ctx, source, headers=headers))[0] == 401
        good = basic(USER, PASSWORD)
        status, body, _ = await get(url + "/metrics", ctx, headers=good)
        assert status == 200 and "vllm_dp_" in body
        assert (await get(url + "/status", ctx, headers=good))[0] == 200
        assert (await get(url + "/", ctx, headers=good))[0] == 200
        assert (await get(url + "/gate", ctx, headers=good))[0] != 401
        assert (await get(url + "/metrics", ctx, headers=basic("other", "pw2")))[0] == 200
        # The probes stay open (kubelet probes carry no credentials); neither names an engine.
        assert (await get(url + "/healthz", ctx))[0] == 200
        assert (await get(url + "/readyz", ctx))[0] == 503


@pytest.mark.slow
async def test_basic_auth_without_tls(pki: Pki, tmp_path: Path) -> None:
    path = pki.dir / "basic-plain.yml"
    write_web_config(path, None, users={USER: PASSWORD})
    config = config_for(str(path), tmp_path)
    assert config.web is not None and config.web.ssl_context is None
    async with serving(config) as (url, _):
        url = url.replace("https://", "http://")
        assert (await get(url + "/metrics", False))[0] == 401
        assert (await get(url + "/metrics", False, headers=basic(USER, PASSWORD)))[0] == 200


@pytest.mark.slow
async def test_admin_over_tls_keeps_its_bearer_token(pki: Pki, tmp_path: Path) -> None:
    web_config(pki, "admin", users={USER: PASSWORD})
    (pki.dir / "admin-headers.yml").write_text(
        (pki.dir / "admin.yml").read_text()
        + "http_server_config:\n  headers:\n    Strict-Transport-Security: max-age=31536000\n"
    )
    config = config_for(str(pki.dir / "admin-headers.yml"), tmp_path)
    ctx = pki.client_context()
    async with serving(config) as (url, admin):
        reset = admin + "/admin/reset_prefix_cache"
        status, _, headers = await post(reset, ctx)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert headers["Strict-Transport-Security"] == "max-age=31536000"
        # The web config's users do not replace the token.
        assert (await post(reset, ctx, headers=basic(USER, PASSWORD)))[0] == 401
        status, body, _ = await post(reset, ctx, headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 503 and "no engine is connected" in body  # authenticated
        with pytest.raises(aiohttp.ClientError):
            await post(reset.replace("https://", "http://"), False)
        # The configured headers are on the metrics listener too.
        _, _, headers = await get(url + "/healthz", ctx)
        assert headers["Strict-Transport-Security"] == "max-age=31536000"


@pytest.mark.slow
async def test_admin_basic_auth_without_a_token(pki: Pki, tmp_path: Path) -> None:
    config = config_for(
        web_config(pki, "admin-basic", users={USER: PASSWORD}), tmp_path, token=False
    )
    ctx = pki.client_context()
    async with serving(config) as (_, admin):
        reset = admin + "/admin/reset_prefix_cache"
        status, _, headers = await post(reset, ctx)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert (await post(reset, ctx, headers=basic(USER, "nope")))[0] == 401
        assert (await post(reset, ctx, headers=basic(USER, PASSWORD)))[0] == 503


async def test_basic_auth_remembers_only_verified_credentials() -> None:
    users = {b"u": bcrypt_hash("pw").encode(), b"v": bcrypt_hash("pw2", 6).encode()}
    auth = BasicAuthChecker(users)
    assert auth.dummy_cost == 6  # unknown users cost as much as the costliest configured hash
    header = basic("u", "pw")["Authorization"]
    assert await auth.check(header)
    assert await auth.check(header) and await auth.check(header)
    assert auth.bcrypt_checks == 1  # one bcrypt run, then the verified credential
    assert not await auth.check(basic("u", "wrong")["Authorization"], "192.0.2.1")
    assert not await auth.check(basic("x", "pw")["Authorization"], "192.0.2.2")
    assert auth.bcrypt_checks == 3  # unknown users cost a bcrypt run too
    assert not await auth.check(basic("u", "p" * 73)["Authorization"], "192.0.2.3")
    assert auth.bcrypt_checks == 3  # over bcrypt's 72 bytes: refused without bcrypt
    assert list(auth._verified) == [b"u"]  # failures are never remembered
    assert all(b"pw" not in v for v in auth._verified.values())  # an HMAC, not the password
    for bad in ("", "Basic", "Basic dTpwdw", "Digest dTpwdw==", "Basic " + "dXB3"):
        assert not await auth.check(bad), bad
    assert len(auth.throttle) == 3  # the three wrong credentials; missing ones are not counted


# -- bad files: one line each, at start-up ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("tls_server_config: {cert_file: server.crt, key_file: server.key}\nfoo: 1\n",
         ["unknown key 'foo'"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, certfile: x}\n",
         ["tls_server_config", "unknown key 'certfile'"]),
        ("tls_server_config: {cert_file: missing.crt, key_file: server.key}\n",
         ["cert_file", "missing.crt", "No such file"]),
        ("tls_server_config: {cert_file: client.crt, key_file: server.key}\n",
         ["not a PEM certificate and its private key"]),
        ("tls_server_config: {cert_file: server.crt}\n", ["needs cert_file and key_file"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "client_auth_type: RequireClientCerts, client_ca_file: ca.crt}\n",
         ["client_auth_type must be one of", "RequireAndVerifyClientCert", "RequireClientCerts"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "client_auth_type: RequireAndVerifyClientCert}\n", ["needs client_ca_file"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "client_ca_file: ca.crt}\n", ["client_auth_type is NoClientCert"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, min_version: TLS14}\n",
         ["min_version must be one of TLS10, TLS11, TLS12, TLS13"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "cipher_suites: [TLS_AES_128_GCM_SHA256]}\n", ["cipher_suites is not supported"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "client_auth_type: VerifyClientCertIfGiven, client_ca_file: server.key}\n",
         ["client CA is not a PEM certificate"]),
        ("basic_auth_users: {prometheus: plaintext-password}\n", ["prometheus: not a bcrypt hash"]),
        ("basic_auth_users: {'a:b': '$2y$10$" + "a" * 53 + "'}\n", ["without ':'"]),
        ("basic_auth_users: [prometheus]\n", ["mapping of username to bcrypt hash"]),
        ("http_server_config: {headers: {Set-Cookie: x}}\n", ["'Set-Cookie' may not be set"]),
        ("tls_server_config:\n  cert_file: [\n", ["invalid YAML at line"]),
        ("- a list\n", ["must be a mapping"]),
        ("basic_auth_users: " + "[" * 5000 + "\n", ["nested too deeply"]),
        ("tls_server_config:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 2000)),
         ["nested too deeply"]),
        ("basic_auth_users:\n  prometheus: '$2y$10$" + "a" * 53 + "'\n"
         "  prometheus: '$2y$10$" + "b" * 53 + "'\n",
         ["basic_auth_users", "duplicate key 'prometheus'", "line 3"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "cert_file: other.crt}\n", ["duplicate key 'cert_file'"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "min_version: TLS13, max_version: TLS12}\n",
         ["min_version TLS13", "above max_version TLS12", "no handshake"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, "
         "max_version: TLS11}\n", ["min_version TLS12 (the default)", "max_version TLS11"]),
        ("http_server_config: {headers: {X-Frame-Options: DENY, x-frame-options: SAMEORIGIN}}\n",
         ["X-Frame-Options", "twice"]),
        ("tls_server_config: {cert_file: server.crt, key_file: server.key, min_version: "
         "&a [[[[*a, *a, *a], *a], *a], *a]}\n", ["min_version must be one of"]),
    ],
)  # fmt: skip
def test_bad_web_config_files(pki: Pki, text: str, words: list[str]) -> None:
    path = pki.dir / "bad.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_web_config(str(path))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"web config file {path}"), message
    assert all(w in message for w in words), (words, message)
    assert "plaintext-password" not in message  # a credential is never echoed


def test_an_empty_web_config_is_plain_http(tmp_path: Path) -> None:
    (tmp_path / "empty.yml").write_text("")
    config = load_web_config(str(tmp_path / "empty.yml"))
    assert config.ssl_context is None and not config.users and config.scheme == "http"
    with pytest.raises(ConfigError, match="No such file"):
        load_web_config(str(tmp_path / "absent.yml"))


@pytest.mark.slow
async def test_serve_exits_2_with_one_line_for_a_bad_web_config(pki: Pki, tmp_path: Path) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text(
        f"tls_server_config: {{cert_file: {pki.server_cert}, key_file: {pki.server_key}, "
        "client_auth_type: Sometimes}\n"
    )
    code, out, err = await run_cli(
        "serve",
        "--engine-count",
        "1",
        "--handshake-address",
        f"tcp://127.0.0.1:{free_listen_port()}",
        "--web-config-file",
        str(bad),
    )
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("vllm-dp-exporter serve: web config file") and "Sometimes" in err


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("basic_auth_users: " + "[" * 20000 + "\n", ["nested too deeply"]),
        ("basic_auth_users:\n  prometheus: '$2y$10$" + "a" * 53 + "'\n"
         "  prometheus: '$2y$10$" + "b" * 53 + "'\n", ["duplicate key 'prometheus'"]),
        ("tls_server_config: {cert_file: CERT, key_file: KEY, min_version: TLS13, "
         "max_version: TLS12}\n", ["min_version TLS13", "max_version TLS12"]),
    ],
    ids=["deep-nesting", "duplicate-user", "tls13-to-tls12"],
)  # fmt: skip
async def test_serve_refuses_a_web_config_that_cannot_work(
    pki: Pki, tmp_path: Path, text: str, words: list[str]
) -> None:
    bad = tmp_path / "web.yml"
    bad.write_text(text.replace("CERT", str(pki.server_cert)).replace("KEY", str(pki.server_key)))
    code, out, err = await run_cli(
        "serve",
        "--engine-count",
        "1",
        "--handshake-address",
        f"tcp://127.0.0.1:{free_listen_port()}",
        "--listen",
        f"127.0.0.1:{free_listen_port()}",
        "--web-config-file",
        str(bad),
    )
    assert code == 2 and out == "", (code, out, err)
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"vllm-dp-exporter serve: web config file {bad}"), err
    assert all(w in err for w in words), (words, err)
    assert "Traceback" not in err and "$2y$" not in err


@pytest.mark.slow
async def test_docker_healthcheck_speaks_tls_when_the_web_config_does(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hc = artefacts.load_script(artefacts.ROOT / "deploy" / "docker" / "healthcheck.py", "hc")
    path = web_config(pki, "healthcheck", users={USER: PASSWORD})
    config = config_for(path, tmp_path)
    argv = ["vllm-dp-exporter", "serve", "--listen", config.listen]
    assert hc.uses_tls([*argv, "--web-config-file", path], {})
    assert hc.uses_tls(argv, {"VLLM_DP_EXPORTER_WEB_CONFIG_FILE": path})
    assert not hc.uses_tls(argv, {})
    monkeypatch.delenv("VLLM_DP_EXPORTER_WEB_CONFIG_FILE", raising=False)
    async with serving(config):
        monkeypatch.setattr(hc, "pid1_argv", lambda: [*argv, f"--web-config-file={path}"])
        assert await asyncio.to_thread(hc.main) == 0
        monkeypatch.setattr(hc, "pid1_argv", lambda: argv)  # plain HTTP: refused
        assert await asyncio.to_thread(hc.main) == 1
