"""``exporter.remote`` and ``ctl`` against an exporter started with ``--web-config-file``: TLS
with a private CA and client certificates, basic auth on both listeners (the admin listener
without a token), and the admin token beside basic auth. The service is the one ``serve``
starts (``start_service``), over simulated engines; certificates from ``tests/harness/tls.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from exporter.commands.ctl import add_ctl_arguments, run_ctl
from exporter.remote import (
    BASIC_AUTH_ENV,
    AuthError,
    BasicAuth,
    Client,
    Credentials,
    Secret,
    Unreachable,
)
from exporter.sim.options import SimOptions
from tests.harness.processes import ROOT, python_cmd
from tests.harness.secure import SecureFleet, SecureFleets
from tests.harness.tls import PASSWORD, USER, Pki, write_web_config

# The certificates come from the openssl CLI (a subprocess).
pytestmark = pytest.mark.slow

TOKEN = "tls-admin-token-4b5c6d7e8f90"


def creds(
    pki: Pki, *, password: str | None = PASSWORD, cert: bool = True, **kw: Any
) -> Credentials:
    basic = BasicAuth(USER, Secret(password)) if password is not None else None
    return Credentials(
        basic_auth=basic,
        ca_file=str(pki.ca_cert),
        cert_file=str(pki.client_cert) if cert else None,
        key_file=str(pki.client_key) if cert else None,
        **kw,
    )


async def mtls_fleet(secure_fleets: SecureFleets, pki: Pki, name: str, **kw: Any) -> SecureFleet:
    web_config = write_web_config(
        pki.dir / f"{name}.yml",
        pki,
        client_auth_type="RequireAndVerifyClientCert",
        users={USER: PASSWORD},
    )
    return await secure_fleets.build(
        2, options=SimOptions(weight_version="v1"), web_config_file=str(web_config), **kw
    )


async def test_tls_client_certificates_and_basic_auth(
    secure_fleets: SecureFleets, pki: Pki
) -> None:
    fleet = await mtls_fleet(secure_fleets, pki, "mtls-basic", gate_min_interval=0.0)
    assert fleet.url.startswith("https://") and fleet.admin_url.startswith("https://")
    async with Client(fleet.url, fleet.admin_url, credentials=creds(pki)) as dp:
        status = await dp.status()
        assert status.engines_connected == 2 and status.consistent
        # No admin token: the web config's basic-auth users authenticate admin requests.
        assert (await dp.pause()).success and (await dp.weight_version("v2")).success
        assert (await dp.resume()).success
        opened = await dp.wait({"weight_version": "v2", "paused": False}, timeout_s=5)
        assert opened.ok
        assert PASSWORD not in repr(dp)
    async with Client(fleet.url, fleet.admin_url, credentials=creds(pki, password="nope")) as dp:
        with pytest.raises(AuthError) as read:
            await dp.status()
        with pytest.raises(AuthError) as admin:
            await dp.resume()
    assert read.value.status == admin.value.status == 401
    assert "basic-auth" in admin.value.detail
    async with Client(fleet.url, None, credentials=creds(pki, password=None)) as dp:
        with pytest.raises(AuthError):
            await dp.gate()


async def test_tls_failures_are_unreachable(secure_fleets: SecureFleets, pki: Pki) -> None:
    fleet = await mtls_fleet(secure_fleets, pki, "mtls-only")
    async with Client(fleet.url, None, credentials=creds(pki, cert=False)) as dp:
        with pytest.raises(Unreachable):  # the server asks for a client certificate
            await dp.status(timeout_s=5)
    untrusting = Credentials(basic_auth=BasicAuth(USER, Secret(PASSWORD)))
    async with Client(fleet.url, None, credentials=untrusting) as dp:
        with pytest.raises(Unreachable, match="Certificate"):  # the system CAs do not know it
            await dp.status(timeout_s=5)
    plain = fleet.url.replace("https://", "http://")
    async with Client(plain, None, credentials=creds(pki)) as dp:
        with pytest.raises(Unreachable):
            await dp.status(timeout_s=5)


async def test_token_for_admin_basic_auth_for_reads(
    secure_fleets: SecureFleets, pki: Pki, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    web_config = write_web_config(pki.dir / "tls-basic.yml", pki, users={USER: PASSWORD})
    fleet = await secure_fleets.build(
        1, web_config_file=str(web_config), admin_token_file=str(token_file)
    )
    both = creds(pki, cert=False, token=Secret(TOKEN))
    async with Client(fleet.url, fleet.admin_url, credentials=both) as dp:
        assert (await dp.status()).engines_connected == 1
        assert (await dp.reset_prefix_cache()).success
    basic_only = creds(pki, cert=False)
    async with Client(fleet.url, fleet.admin_url, credentials=basic_only) as dp:
        with pytest.raises(AuthError, match="bearer token"):  # the token stays the credential
            await dp.resume()


async def ctl(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_ctl_arguments(parser)
    code = await asyncio.to_thread(run_ctl, parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return code, out, err


async def test_ctl_speaks_tls_and_basic_auth(
    secure_fleets: SecureFleets,
    pki: Pki,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = await mtls_fleet(secure_fleets, pki, "mtls-ctl", gate_min_interval=0.0)
    basic_file = tmp_path / "basic"
    basic_file.write_text(f"{USER}:{PASSWORD}\n")
    tls = (
        *("--ca-file", str(pki.ca_cert)),
        *("--cert-file", str(pki.client_cert)),
        *("--key-file", str(pki.client_key)),
    )
    auth = ("--basic-auth-file", str(basic_file))
    code, out, err = await ctl(capsys, "status", "--url", fleet.url, *tls, *auth)
    assert code == 0, err
    assert out.startswith("fleet: awake  engines connected 2/2")
    code, out, err = await ctl(capsys, "pause", "--admin-url", fleet.admin_url, *tls, *auth)
    assert code == 0, err
    assert out.splitlines()[0] == "pause: success"
    code, out, err = await ctl(
        capsys, "wait", "--url", fleet.url, "--paused", "--timeout", "5", *tls, *auth
    )
    assert code == 0, err
    assert out.strip() == "gate open: 2 engines meet paused=true"

    # The environment instead of a file; the file wins when both are given.
    monkeypatch.setenv(BASIC_AUTH_ENV, f"{USER}:{PASSWORD}")
    code, out, err = await ctl(capsys, "resume", "--admin-url", fleet.admin_url, *tls)
    assert code == 0, err
    wrong = tmp_path / "wrong"
    wrong.write_text(f"{USER}:not-the-password")
    code, _, err = await ctl(
        capsys, "status", "--url", fleet.url, *tls, "--basic-auth-file", str(wrong)
    )
    assert code == 1 and "HTTP 401" in err
    monkeypatch.delenv(BASIC_AUTH_ENV)
    code, out, err = await ctl(capsys, "reset-prefix-cache", "--admin-url", fleet.admin_url, *tls)
    assert code == 1 and "HTTP 401: missing or invalid basic-auth credentials" in err
    code, out, err = await ctl(capsys, "status", "--url", fleet.url, *auth)  # no CA given
    assert code == 1 and "Certificate" in err and "Traceback" not in err
    bad = tmp_path / "bad"
    bad.write_text("no-colon-here")
    code, _, err = await ctl(
        capsys, "status", "--url", fleet.url, *tls, "--basic-auth-file", str(bad)
    )
    assert code == 1 and f"cannot use basic-auth file {bad}: must hold user:password" in err
    code, _, err = await ctl(capsys, "status", "--url", fleet.url, "--ca-file", str(tmp_path / "x"))
    assert code == 1 and "cannot use CA file" in err
    for text in (out, err):
        assert PASSWORD not in text


async def test_the_real_command_reads_the_environment(
    secure_fleets: SecureFleets, pki: Pki
) -> None:
    fleet = await mtls_fleet(secure_fleets, pki, "mtls-process")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_EXPORTER_")}
    env[BASIC_AUTH_ENV] = f"{USER}:{PASSWORD}"
    proc = await asyncio.create_subprocess_exec(
        *python_cmd(
            "ctl",
            "status",
            "--url",
            fleet.url,
            "--ca-file",
            str(pki.ca_cert),
            "--cert-file",
            str(pki.client_cert),
            "--key-file",
            str(pki.client_key),
        ),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=env,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    assert out.decode().startswith("fleet: awake  engines connected 2/2")
    assert PASSWORD not in out.decode() + err.decode()
