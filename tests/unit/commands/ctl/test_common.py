"""What every ``ctl`` subcommand shares: tables that cannot be forged by what engines send,
the connection options, the credentials read from files or the environment (never the command
line), and the admin request's exit codes."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from exporter.commands.ctl.common import (
    EXIT_ERROR,
    EXIT_OK,
    EXIT_PARTIAL,
    EXIT_UNSUPPORTED,
    add_admin_options,
    connect,
    post_admin,
    table,
    text,
)
from exporter.error import ConfigError
from exporter.remote import (
    BASIC_AUTH_ENV,
    ActionResult,
    Client,
    Conflict,
    PartialFailure,
    RemoteError,
    Unreachable,
    Unsupported,
)

ANSWER = {"engines": [{"engine": 0, "ok": False, "reason": "refused"}], "outcome": "failure"}


@pytest.fixture(autouse=True)
def no_basic_auth_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BASIC_AUTH_ENV, raising=False)


def admin_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_admin_options(parser, 12.5)
    return parser.parse_args(list(argv))


def test_the_exit_codes_are_distinct_and_leave_probe_s_3_alone() -> None:
    codes = [EXIT_OK, EXIT_ERROR, EXIT_PARTIAL, EXIT_UNSUPPORTED]
    assert codes == [0, 1, 2, 4]


def test_a_table_pads_each_column_to_its_widest_cell() -> None:
    rows = [["0", "yes", "-"], ["10", "no", "refused"]]
    assert table(["ENGINE", "OK", "REASON"], rows).splitlines() == [
        "ENGINE  OK   REASON",
        "0       yes  -",
        "10      no   refused",
    ]
    assert table(["A", "B"], []) == "A  B"


def test_a_cell_is_escaped_so_it_cannot_move_the_cursor_or_add_a_row() -> None:
    assert (text(None), text(True), text(False), text(3)) == ("-", "true", "false", "3")
    assert text("v1\n0       yes") == "v1\\n0       yes"
    assert text("\x1b[2J") == "\\x1b[2J"
    assert len(table(["E"], [[text("a\nb")]]).splitlines()) == 2


def test_the_admin_options_and_their_defaults() -> None:
    args = admin_args()
    assert (args.admin_url, args.timeout, args.json) == ("http://127.0.0.1:19401", 12.5, False)
    assert args.token_file is None and args.idempotency_key is None and args.ca_file is None
    given = admin_args("--timeout", "3", "--idempotency-key", "k1", "--basic-auth-file", "f")
    assert (given.timeout, given.idempotency_key, given.basic_auth_file) == (3.0, "k1", "f")


def test_connect_reads_the_files_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    token.chmod(0o600)
    client = connect(admin_args("--token-file", str(token)), url=None, admin_url="http://h:1/")
    assert isinstance(client, Client) and client.url is None and client.admin_url == "http://h:1"
    assert client.credentials.admin_authorization() == "Bearer tok-123"
    monkeypatch.setenv(BASIC_AUTH_ENV, "alice:pw")
    from_env = connect(admin_args(), url="http://h:2", admin_url=None)
    assert from_env.credentials.read_authorization() == "Basic YWxpY2U6cHc="
    with pytest.raises(ConfigError, match="token file"):
        connect(admin_args("--token-file", str(tmp_path / "none")), url=None, admin_url=None)


async def run(args: argparse.Namespace, error: BaseException | None) -> int:
    """``post_admin`` with a call that answers (``error`` None) or raises ``error``."""
    result = ActionResult.from_json("sleep", 200 if error is None else 502, ANSWER)

    async def call(client: Client) -> ActionResult:
        assert client.admin_url == "http://127.0.0.1:19401"
        if error is not None:
            raise error
        return result

    return await post_admin(args, lambda body: f"TABLE {len(body['engines'])}", call)


async def test_post_admin_exit_codes_and_what_it_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    partial_result = ActionResult.from_json("sleep", 502, ANSWER)
    assert await run(admin_args(), None) == EXIT_OK
    assert capsys.readouterr().out == "TABLE 1\n"
    partial = PartialFailure("sleep: failure", result=partial_result, status=502)
    assert await run(admin_args(), partial) == EXIT_PARTIAL
    assert capsys.readouterr() == ("TABLE 1\n", "")
    unsupported = Unsupported("sleep: unsupported (no sleep mode)", status=501)
    assert await run(admin_args(), unsupported) == EXIT_UNSUPPORTED
    assert capsys.readouterr() == ("", "ctl: sleep: unsupported (no sleep mode)\n")
    busy = Conflict("HTTP 409: busy", status=409, body={"error": "busy"})
    assert await run(admin_args(), busy) == EXIT_ERROR
    assert capsys.readouterr() == ("", "ctl: HTTP 409: busy\n")  # no engines: no table
    assert await run(admin_args(), Unreachable("ClientConnectorError: refused")) == EXIT_ERROR
    assert capsys.readouterr().err == "ctl: ClientConnectorError: refused\n"


async def test_post_admin_json_prints_the_answer_as_sent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    failed = RemoteError("HTTP 500: boom", status=500, body={"error": "boom"})
    assert await run(admin_args("--json"), failed) == EXIT_ERROR
    assert capsys.readouterr() == ('{"error": "boom"}\n', "ctl: HTTP 500: boom\n")
