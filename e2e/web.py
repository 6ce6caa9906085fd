"""Small blocking HTTP helpers (stdlib only) and a bounded wait, for the suite's assertions."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    method: str,
    url: str,
    payload: Any = None,
    timeout_s: float = 10.0,
    headers: Mapping[str, str] | None = None,
) -> Reply:
    """One HTTP request; HTTP error statuses are returned, connection errors raise OSError."""
    data = json.dumps(payload).encode() if payload is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return Reply(resp.status, resp.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.read())


def get(url: str, timeout_s: float = 10.0) -> Reply:
    return request("GET", url, timeout_s=timeout_s)


def post(url: str, payload: Any = None, timeout_s: float = 10.0) -> Reply:
    return request("POST", url, payload, timeout_s=timeout_s)


def answers(url: str) -> int | None:
    """The status ``GET url`` answers, or None when nothing accepts the connection."""
    try:
        return get(url, timeout_s=5.0).status
    except OSError:
        return None


def wait_for(
    probe: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.5,
    abort: Callable[[], str | None] | None = None,
) -> T:
    """Call ``probe`` until it returns something truthy (returned) or ``timeout_s`` passes.

    ``abort`` is asked each round and ends the wait early with its message (a process that
    should be serving has exited: waiting longer would only hide the cause).
    """
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while True:
        try:
            last = probe()
        except OSError:
            last = None
        if last:
            return last
        reason = abort() if abort else None
        if reason:
            raise AssertionError(f"gave up waiting for {what}: {reason}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


class Scrape:
    """One parsed Prometheus scrape: ``value(name, **labels)`` for exactly one sample."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for f in text_string_to_metric_families(text) for s in f.samples]

    def find(self, name: str, **labels: str) -> list[Any]:
        return [s for s in self.samples if s.name == name and labels.items() <= s.labels.items()]

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample's value, None when absent; two matches are a test bug."""
        found = self.find(name, **labels)
        assert len(found) <= 1, f"{name}{labels} matches {len(found)} samples"
        return float(found[0].value) if found else None

    def total(self, name: str, **labels: str) -> float:
        """Sum over every sample matching ``labels`` (0 when none)."""
        return float(sum(s.value for s in self.find(name, **labels)))
