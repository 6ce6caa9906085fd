"""Test-time certificates (a self-signed CA, a server and a client certificate, made with the
``openssl`` CLI) and exporter-toolkit web configuration files that use them."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import bcrypt
import pytest

USER, PASSWORD = "prometheus", "s3cret-scrape-pw"


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    #: A client certificate signed by another CA (not trusted by the server).
    rogue_cert: Path
    rogue_key: Path

    def client_context(self, *, with_cert: bool = False, rogue: bool = False) -> ssl.SSLContext:
        """A client context trusting the test CA, optionally presenting a client certificate."""
        ctx = ssl.create_default_context(cafile=str(self.ca_cert))
        if with_cert:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        if rogue:
            ctx.load_cert_chain(str(self.rogue_cert), str(self.rogue_key))
        return ctx


def _openssl(*args: str, cwd: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed (Debian package openssl)")
    proc = subprocess.run([openssl, *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"openssl {' '.join(args)}:\n{proc.stderr}"


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip


def _leaf(d: Path, name: str, ca: str, extensions: str) -> None:
    (d / f"{name}.ext").write_text(
        extensions + "\nauthorityKeyIdentifier=keyid,issuer\nsubjectKeyIdentifier=hash\n"
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
    )
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(
        d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth"
    )
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth")
    return Pki(
        d,
        d / "ca.crt",
        d / "server.crt",
        d / "server.key",
        d / "client.crt",
        d / "client.key",
        d / "rogue.crt",
        d / "rogue.key",
    )


def bcrypt_hash(password: str, rounds: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


def write_web_config(
    path: Path,
    pki: Pki | None,
    *,
    client_auth_type: str | None = None,
    users: dict[str, str] | None = None,
    extra_tls: str = "",
    rounds: int = 4,
) -> Path:
    """A web config file: TLS with ``pki``'s server certificate (relative paths, as
    exporter-toolkit resolves them against the file's directory), basic auth for ``users``
    (username → password, hashed here at bcrypt cost ``rounds``)."""
    lines = []
    if pki is not None:
        lines += [
            "tls_server_config:",
            f"  cert_file: {pki.server_cert.name}",
            f"  key_file: {pki.server_key.name}",
        ]
        if client_auth_type:
            lines += [
                f"  client_auth_type: {client_auth_type}",
                f"  client_ca_file: {pki.ca_cert.name}",
            ]
        lines += [f"  {line}" for line in extra_tls.splitlines() if line]
    if users:
        lines.append("basic_auth_users:")
        lines += [f"  {name}: '{bcrypt_hash(pw, rounds)}'" for name, pw in users.items()]
    path.write_text("\n".join(lines) + "\n")
    return path
