"""The label values of the exporter's series (``exporter.metrics.labels``): bounded tuples the
collector, the docs and the alert rules share, so they must stay unique and agree with the
types whose values they name."""

from __future__ import annotations

import pytest

from exporter.client.fleet import Outcome
from exporter.control.actions import ACTIONS
from exporter.metrics import labels
from exporter.protocol.handshake import REGISTRATION_FACTS


@pytest.mark.parametrize(
    "values",
    [
        labels.ENGINE_STATES,
        labels.INFO_FACTS,
        labels.FLEET_STATES,
        labels.CALL_OUTCOMES,
        labels.RESET_OUTCOMES,
        labels.RESET_FAILURE_REASONS,
        labels.ADMIN_ACTIONS,
    ],
)
def test_each_label_set_is_non_empty_and_has_no_duplicates(values: tuple[str, ...]) -> None:
    assert values
    assert len(set(values)) == len(values)
    assert all(isinstance(v, str) and v and v == v.strip() for v in values)


def test_call_outcomes_are_exactly_the_client_outcomes() -> None:
    """Every ``Outcome`` a call can end in has a series, and no series names another."""
    assert set(labels.CALL_OUTCOMES) == {o.value for o in Outcome}


def test_admin_actions_are_exactly_the_registered_actions() -> None:
    assert set(labels.ADMIN_ACTIONS) == set(ACTIONS)


def test_info_facts_are_registration_facts_or_front_end_ones() -> None:
    """An info label names a fact the registration carries, or one HTTP mode reads itself."""
    registered = {name for name, _ in REGISTRATION_FACTS}
    extra = set(labels.INFO_FACTS) - registered
    assert extra == {"front_end", "rust_frontend_version"}
    # A per-start instance id would add a series per restart: never a label.
    assert "instance_id" not in labels.INFO_FACTS


def test_unknown_is_a_value_of_the_state_sets_that_can_be_unknown() -> None:
    assert labels.UNKNOWN_FACT == "unknown"
    assert labels.ENGINE_STATES[-1] == "unknown"
    assert "unknown" in labels.FLEET_STATES
    assert "unknown" not in labels.CALL_OUTCOMES  # a call always ends in one of its outcomes
