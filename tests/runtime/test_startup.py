"""The phases of a run's start (``airflow_arroyo.runtime.startup``), from the steps a driver notes."""

from __future__ import annotations

import pytest

from airflow_arroyo.runtime.startup import PHASES, start_phases


def test_a_restore_has_every_phase_each_from_the_end_of_the_one_before() -> None:
    steps = {"registered": 1.0, "verified": 1.5, "prepared:src": 2.0, "prepared:agg": 4.0, "committed": 4.25,
             "switched:src": 4.3, "truncated:src": 4.4, "restored": 4.5, "queries-started": 9.5, "warm": 12.0}
    phases = start_phases(steps)
    assert list(phases) == list(PHASES)
    assert phases == pytest.approx({"plan": 1.0, "check": 0.5, "rebuild": 2.75, "roll_forward": 0.25,
                                    "queries": 5.0, "first_batch": 2.5})
    assert sum(phases.values()) == pytest.approx(steps["warm"])


def test_a_cold_start_has_no_restore_phases_and_its_queries_start_after_registering() -> None:
    assert start_phases({"registered": 0.5, "queries-started": 6.0, "warm": 8.0}) == pytest.approx(
        {"plan": 0.5, "queries": 5.5, "first_batch": 2.0})


def test_a_start_that_failed_midway_has_the_phases_it_ended() -> None:
    assert start_phases({"registered": 0.5, "verified": 0.75}) == pytest.approx({"plan": 0.5, "check": 0.25})
    assert start_phases({}) == {}
