"""Fixtures of the operator tests: the store and Spark connections, the process groups a test started."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import pytest

from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.store import EpochStore

CONN = "arroyo_test"
SPARK = "spark_test"


@pytest.fixture
def no_defer_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    """No settle hold here (no scheduler to race; tests/airflow/test_defer_settle.py covers it)."""
    monkeypatch.setattr("airflow_arroyo.triggers.settle.DEFER_SETTLE_S", 0.0)


@pytest.fixture
def conns(store: EpochStore, monkeypatch: pytest.MonkeyPatch) -> EpochStore:
    """Connections as environment variables: the epoch store, and Spark local[2] as JSON."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", store.dsn)
    monkeypatch.setenv(f"AIRFLOW_CONN_{SPARK.upper()}", json.dumps({"conn_type": "spark", "host": "local[2]"}))
    return store


@pytest.fixture
def started() -> Iterator[list[LocalProcess]]:
    """Process groups a test started: killed at teardown if the test left them running."""
    groups: list[LocalProcess] = []
    yield groups
    for group in groups:
        group.signal_group(signal.SIGKILL)
