"""``exporter.remote``'s base URLs (a path prefix kept, credentials refused) and credentials
(tokens and passwords from files or the environment, never in a repr)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.error import ConfigError
from exporter.remote import BASIC_AUTH_ENV, BasicAuth, Client, Credentials, Secret, SyncClient
from exporter.remote.urls import base_url, join

PASSWORD = "pa:ss-w0rd"
TOKEN = "unit-token-0a1b2c3d"


def test_base_urls_keep_their_prefix() -> None:
    assert base_url("http://127.0.0.1:8000/dp/") == "http://127.0.0.1:8000/dp"
    assert base_url("https://[::1]:19400") == "https://[::1]:19400"
    assert join(base_url("http://h:8000/dp"), "admin/sleep") == "http://h:8000/dp/admin/sleep"
    assert join("http://h:19400", "/status") == "http://h:19400/status"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("", "non-empty"),
        ("127.0.0.1:19400", "http:// or https://"),
        ("ftp://h/", "http:// or https://"),
        ("http:///status", "names no host"),
        ("http://user:pw@h:19400", "must not carry credentials"),
        ("http://h:19400/?x=1", "query or fragment"),
        ("http://h:19400/#top", "query or fragment"),
        ("http://h:19400?", "query or fragment"),
        ("http://h:99999", "out of range"),
        ("http://h:0", "port 0"),
        ("http://h /x", "space or a control character"),
        ("http://h\x1b[2J", "space or a control character"),
    ],
)
def test_base_urls_that_cannot_be_used(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match="admin URL") as bad:
        base_url(url, "admin URL")
    assert why in str(bad.value)
    assert "pw" not in str(bad.value) or why != "must not carry credentials"


def test_secrets_never_show() -> None:
    creds = Credentials(Secret(TOKEN), BasicAuth("alice", Secret(PASSWORD)), ca_file="ca.crt")
    no_tls = Credentials(Secret(TOKEN), BasicAuth("alice", Secret(PASSWORD)))
    shown = (repr(creds), str(creds), repr(creds.basic_auth), repr(Client(credentials=no_tls)))
    for text in shown:
        assert TOKEN not in text and PASSWORD not in text
    assert "alice" in repr(creds) and "ca.crt" in repr(creds)
    assert repr(Secret(TOKEN)) == str(Secret(TOKEN)) == "Secret('********')"
    assert creds.admin_authorization() == f"Bearer {TOKEN}"  # the token is the admin credential
    assert creds.read_authorization() == "Basic YWxpY2U6cGE6c3MtdzByZA=="  # never the token
    basic_only = Credentials(basic_auth=BasicAuth("alice", Secret(PASSWORD)))
    assert basic_only.admin_authorization() == basic_only.read_authorization()
    assert Credentials().admin_authorization() is None


def test_basic_auth_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "basic"
    path.write_text(f"alice:{PASSWORD}\n")
    basic = BasicAuth.from_file(str(path))
    assert (basic.user, basic.password.reveal()) == ("alice", PASSWORD)
    assert BasicAuth.from_env(environ={}) is None
    from_env = BasicAuth.from_env(environ={BASIC_AUTH_ENV: "bob:x"})
    assert from_env is not None and from_env.user == "bob"
    loaded = Credentials.load(
        basic_auth_file=str(path),
        basic_auth_env=BASIC_AUTH_ENV,
        environ={BASIC_AUTH_ENV: "bob:x"},
    )
    assert loaded.basic_auth is not None and loaded.basic_auth.user == "alice"  # the file wins


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("alice", "must hold user:password"),
        (":pw", "non-empty"),
        ("alice:", "password is empty"),
        ("alice:pw\nbob:pw\n", "several lines"),
        ("alice:p\x1bw", "control character"),
        ("al\x07ice:pw", "control character"),
    ],
)
def test_basic_auth_that_cannot_be_used(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "basic"
    path.write_text(content)
    with pytest.raises(ConfigError) as bad:
        BasicAuth.from_file(str(path))
    assert why in str(bad.value) and str(path) in str(bad.value)
    assert "pw" not in str(bad.value).replace(str(path), "")
    with pytest.raises(ConfigError, match=BASIC_AUTH_ENV):
        BasicAuth.from_env(environ={BASIC_AUTH_ENV: content})


def test_tokens_from_a_file_or_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    token = Credentials.load(token_file=str(path)).token
    assert token is not None and token.reveal() == TOKEN
    env_token = Credentials.load(token_env="MY_TOKEN", environ={"MY_TOKEN": TOKEN}).token
    assert env_token is not None and env_token.reveal() == TOKEN
    assert Credentials.load(token_env="MY_TOKEN", environ={}).token is None
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        Credentials.load(token_file=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="token file"):
        Credentials.load(token_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="one line"):
        Credentials(Secret("two\nlines"))


def test_tls_settings_that_cannot_be_used(tmp_path: Path) -> None:
    assert Credentials().ssl_context() is None
    with pytest.raises(ConfigError, match="needs its certificate"):
        Credentials(key_file="client.key")
    with pytest.raises(ConfigError, match=r"CA file .*missing"):
        Credentials(ca_file=str(tmp_path / "missing")).ssl_context()
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ConfigError, match="CA file"):
        Credentials(ca_file=str(garbage)).ssl_context()
    with pytest.raises(ConfigError, match="client certificate"):
        Credentials(cert_file=str(garbage), key_file=str(garbage)).ssl_context()
    with pytest.raises(ConfigError, match="admin URL"):
        Client("http://127.0.0.1:19400", "ftp://nope")
    with pytest.raises(ConfigError, match="CA file"):  # before any thread starts
        SyncClient(credentials=Credentials(ca_file=str(garbage)))
