"""The root of ``exporter.remote``'s errors keeps what the exporter said (status, body, the
printable detail, the URL asked), so a caller never parses the message to learn it."""

from __future__ import annotations

from exporter.error import ExporterError
from exporter.remote.errorbase import InvalidAnswer, RemoteError


def test_an_error_with_no_answer_has_its_message_as_detail() -> None:
    error = RemoteError("ClientConnectorError: refused", url="http://h:1/status")
    assert str(error) == "ClientConnectorError: refused"
    assert error.detail == "ClientConnectorError: refused"
    assert (error.status, error.body, error.url) == (None, None, "http://h:1/status")


def test_an_answer_s_own_text_is_the_detail() -> None:
    body = {"error": "another admin action is running"}
    error = RemoteError("HTTP 409: busy", status=409, body=body, detail=body["error"])
    assert str(error) == "HTTP 409: busy"
    assert error.detail == "another admin action is running"
    assert error.status == 409 and error.body is body


def test_an_empty_detail_is_kept_not_replaced_by_the_message() -> None:
    """Only a missing detail falls back to the message: an empty one is what was sent."""
    assert RemoteError("HTTP 500", detail="").detail == ""


def test_the_family_belongs_to_the_exporter_s_errors() -> None:
    invalid = InvalidAnswer("HTTP 200: the answer is not JSON", status=200)
    assert isinstance(invalid, RemoteError) and isinstance(invalid, ExporterError)
    assert invalid.status == 200 and invalid.body is None
    assert not issubclass(RemoteError, InvalidAnswer)
