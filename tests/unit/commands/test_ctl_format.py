"""The ctl tables tell paused apart from asleep (vLLM's is_sleeping is true for both)."""

from __future__ import annotations

from typing import Any

from exporter.commands.ctl import format_status
from exporter.remote.status import Status


def _status(sleeping: bool, paused: bool | None) -> dict[str, Any]:
    return {
        "engines_connected": 1,
        "engines_expected": 1,
        "last_poll": {"number": 3},
        "aggregate": {
            "is_sleeping": {"state": "consistent", "value": sleeping},
            "is_scheduler_paused": {
                "state": "consistent" if paused is not None else "unknown",
                "value": paused,
            },
        },
        "engines": [{"engine": "0", "state": "paused" if paused else "asleep", "up": True}],
    }


def test_fleet_verdict_words() -> None:
    assert format_status(_status(True, True)).startswith("fleet: paused ")
    assert format_status(_status(True, False)).startswith("fleet: asleep ")
    assert format_status(_status(True, None)).startswith("fleet: asleep ")
    assert format_status(_status(False, False)).startswith("fleet: awake ")


def test_the_table_names_faulty_ranks() -> None:
    body = _status(False, False)
    body["fault_tolerance"] = {"healthy": False, "faulty_engines": ["0"], "reported_engines": ["0"]}
    body["engines"][0]["fault_tolerance"] = {"status": "unhealthy", "fault_info": "RuntimeError"}
    head, header, row = format_status(body).splitlines()
    assert head.endswith("FAULTY 0") and "FAULT" in header.split()
    assert "unhealthy (RuntimeError)" in row
    assert "FAULTY" not in format_status(_status(False, False))
    assert format_status(_status(False, False)).splitlines()[2].split()[6] == "-"


def test_a_mode_that_cannot_know_says_so_and_never_healthy() -> None:
    """E4: relay mode's null verdict reads as not available, in ctl and in exporter.remote."""
    body = _status(False, False)
    body["fault_tolerance"] = {
        "healthy": None,
        "faulty_engines": [],
        "reported_engines": [],
        "note": "not available in this attach mode",
    }
    head = format_status(body).splitlines()[0]
    assert head.endswith("fault tolerance: not available in this mode")
    assert Status.from_json(body).healthy is None


def test_wait_healthy_asks_the_gate_for_healthy_ranks() -> None:
    import argparse

    from exporter.commands.ctl.wait import add_wait_command, gate_params

    parser = argparse.ArgumentParser()
    add_wait_command(parser.add_subparsers())
    assert gate_params(parser.parse_args(["wait", "--healthy"])) == {"healthy": "true"}
    assert "healthy" not in gate_params(parser.parse_args(["wait", "--awake"]))
