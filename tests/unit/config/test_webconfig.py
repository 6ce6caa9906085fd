"""``--web-config-file`` (``exporter.config.webconfig``): every mistake is refused at load with
one line naming the file and the key, since a web config silently half-applied would leave a
listener without the TLS or authentication its operator asked for."""

from __future__ import annotations

from pathlib import Path

import pytest

from exporter.config.webconfig import WebConfig, load_web_config
from exporter.error import ConfigError

HASH = "$2b$04$" + "a" * 53


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "web.yml"
    path.write_text(text)
    return str(path)


def test_basic_auth_and_headers_without_tls_load_as_plain_http(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        f"basic_auth_users:\n  prometheus: '{HASH}'\n"
        "http_server_config:\n  http2: true\n  headers:\n    x-frame-options: DENY\n",
    )
    config = load_web_config(path)
    assert config.scheme == "http" and config.ssl_context is None
    assert config.client_auth_type == "NoClientCert"
    assert config.users == {b"prometheus": HASH.encode()}
    assert config.headers == {"X-Frame-Options": "DENY"}  # canonical spelling


def test_an_empty_file_is_no_tls_and_no_users(tmp_path: Path) -> None:
    assert load_web_config(write(tmp_path, "")) == WebConfig(write(tmp_path, ""))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tls_config: {}\n", "unknown key 'tls_config'"),
        ("tls_server_config:\n  cipher_suites: []\n", "cipher_suites is not supported"),
        ("tls_server_config: [1]\n", "tls_server_config must be a mapping, got list"),
        ("tls_server_config:\n  min_version: TLS12\n", "needs cert_file and key_file"),
        ("http_server_config:\n  http2: yes please\n", "http2 must be true or false"),
        ("http_server_config:\n  headers:\n    Server: x\n", "header 'Server' may not be set"),
        ("[1, 2]\n", "must be a mapping, got list"),
    ],
)
def test_keys_and_shapes_are_checked(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match="web config file") as caught:
        load_web_config(path)
    assert message in str(caught.value)
    assert path in str(caught.value)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, f"basic_auth_users:\n  a: '{HASH}'\n  a: '{HASH}'\n")
    with pytest.raises(ConfigError, match=r"basic_auth_users: duplicate key 'a' at line 3"):
        load_web_config(path)


def test_a_header_set_twice_in_two_spellings_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "http_server_config:\n  headers:\n    X-Frame-Options: DENY\n    x-frame-options: DENY\n",
    )
    with pytest.raises(ConfigError, match="X-Frame-Options is set twice"):
        load_web_config(path)


@pytest.mark.parametrize(
    ("users", "message"),
    [
        ("  alice: plaintext\n", "alice: not a bcrypt hash"),
        (f"  'a:b': '{HASH}'\n", "must be a non-empty string without ':'"),
        (f"  alice: '$2b$03${'a' * 53}'\n", "not a bcrypt hash"),  # cost below 04
    ],
)
def test_users_need_a_name_without_colon_and_a_bcrypt_hash(
    tmp_path: Path, users: str, message: str
) -> None:
    path = write(tmp_path, "basic_auth_users:\n" + users)
    with pytest.raises(ConfigError) as caught:
        load_web_config(path)
    assert message in str(caught.value)
    assert "plaintext" not in str(caught.value)  # a secret is never echoed


def test_invalid_yaml_names_line_and_column(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid YAML at line 2, column 7: mapping values"):
        load_web_config(write(tmp_path, "basic_auth_users:\n  a: b: c\n"))


def test_tls_files_are_checked_relative_to_the_config(tmp_path: Path) -> None:
    """Paths are read next to the web config, and a file that is no PEM is one clear error."""
    (tmp_path / "server.crt").write_text("not a certificate\n")
    (tmp_path / "server.key").write_text("not a key\n")
    path = write(
        tmp_path,
        "tls_server_config:\n  cert_file: server.crt\n  key_file: server.key\n",
    )
    with pytest.raises(ConfigError, match="are not a PEM certificate and its private key"):
        load_web_config(path)
    missing = write(tmp_path, "tls_server_config:\n  cert_file: nope.crt\n  key_file: nope.key\n")
    with pytest.raises(ConfigError, match="cert_file"):
        load_web_config(missing)


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ("  min_version: TLS13\n  max_version: TLS12\n", "min_version TLS13 is above max_version"),
        ("  max_version: TLS11\n", "min_version TLS12 (the default) is above max_version TLS11"),
        ("  min_version: SSL3\n", "min_version must be one of TLS10, TLS11, TLS12, TLS13"),
    ],
)
def test_a_tls_version_range_no_handshake_could_use_is_refused(
    tmp_path: Path, tls: str, message: str
) -> None:
    (tmp_path / "c").write_text("x")
    path = write(tmp_path, "tls_server_config:\n  cert_file: c\n  key_file: c\n" + tls)
    with pytest.raises(ConfigError) as caught:
        load_web_config(path)
    assert message in str(caught.value)
