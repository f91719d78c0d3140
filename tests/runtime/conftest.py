"""Fixtures of the runtime tests."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_arroyo.store import EpochStore


@pytest.fixture(scope="module")
def module_store(pg_server: Any, request: pytest.FixtureRequest) -> Iterator[EpochStore]:
    """An epoch store in a database of its own, shared by one test module."""
    prefix = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")[:20]
    store = EpochStore(pg_server.create_database(f"{prefix}_{uuid.uuid4().hex[:10]}"))
    store.migrate()
    yield store
    store.close()
