"""End-to-end tests: real Airflow standalone, real PostgreSQL, real Spark (marker ``e2e``)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: end-to-end tests against a real airflow standalone")
