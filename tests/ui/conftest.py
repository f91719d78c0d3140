"""Fixtures of the UI tests: one realistic epoch store per module, and the real Airflow api-server app
(``airflow.api_fastapi.app.create_app()``) with our plugin mounted the way Airflow mounts it."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import EpochStore
from tests.ui.data import Dataset, populate


@pytest.fixture(scope="session")
def pg_server() -> Iterator[ThrowawayPostgres]:
    """Overrides the root fixture: pytest's 0700 temp folders are closed to the ``postgres`` user the
    server runs as when the tests run as root; ThrowawayPostgres makes its own reachable folder."""
    pg = ThrowawayPostgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.cleanup()


@pytest.fixture(scope="session")
def dataset(pg_server: ThrowawayPostgres) -> Iterator[Dataset]:
    """Five pipelines, hundreds of epochs, acks, cleanup runs and a held lock (see tests/ui/data.py).
    Session-wide: the UI only reads, and no test here writes to it."""
    dsn = pg_server.create_database(f"ui_{uuid.uuid4().hex[:12]}")
    store = EpochStore(dsn)
    store.migrate()
    try:
        yield populate(store)
    finally:
        store.close()


@pytest.fixture(scope="module")
def airflow_api(airflow_db: str, dataset: Dataset) -> Iterator[Any]:
    """Airflow's own api-server app, plugins loaded, our app mounted at /arroyo, reading ``dataset``."""
    from airflow.api_fastapi.app import create_app, purge_cached_app

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", dataset.dsn)
        app = create_app()
        source = mounted_arroyo_app(app).state.arroyo_source
        source.reset()  # the plugin app is built once per process: point it at this module's store
        try:
            yield app
        finally:
            source.reset()
            purge_cached_app()


def mounted_arroyo_app(app: Any) -> Any:
    from fastapi.routing import Mount

    mounts = [r for r in app.routes if isinstance(r, Mount) and r.path == "/arroyo"]
    assert len(mounts) == 1, [getattr(r, "path", r) for r in app.routes]
    return mounts[0].app


def make_token(username: str = "admin", role: str | None = "admin") -> str:
    """A JWT minted by the running auth manager, exactly as its login endpoint does."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=username, role=role))


@pytest.fixture(scope="module")
def client(airflow_api: Any) -> Iterator[Any]:
    """An authenticated client (Bearer token of an Airflow viewer)."""
    from fastapi.testclient import TestClient

    with TestClient(airflow_api) as c:
        c.headers["Authorization"] = f"Bearer {make_token('viewer_vera', 'viewer')}"
        yield c


@pytest.fixture(scope="module")
def anon(airflow_api: Any) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    with TestClient(airflow_api) as c:
        yield c
