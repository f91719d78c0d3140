"""ArroyoHook: connection -> DSN, shared migrated stores (sync and async), typed errors, no password in logs."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg2.extensions
import pytest
from airflow.sdk import Connection

from airflow_arroyo.core.exceptions import ConfigurationError, StoreError, TransientStoreError
from airflow_arroyo.hooks import arroyo as hook_module
from airflow_arroyo.hooks.arroyo import ArroyoHook, dsn_from_connection
from airflow_arroyo.store import AsyncEpochStore, EpochStore, available_migrations

PASSWORD = "s3cr#t p@ss/word"  # characters that need escaping in a URI


@pytest.fixture(autouse=True)
def fresh_shared_stores() -> Iterator[None]:
    hook_module._reset_shared_stores()
    yield
    hook_module._reset_shared_stores()


def _with_password(dsn: str, password: str) -> str:
    """The test server trusts 127.0.0.1, so any password connects: enough to prove it never leaks."""
    from urllib.parse import quote

    parts = urlsplit(dsn)
    netloc = f"{parts.username}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def test_arroyo_connection_fields_round_trip_through_the_dsn() -> None:
    conn = Connection(conn_id="x", conn_type="arroyo", host="db.example", port=6543, schema="epochs",
                      login="ar@oyo", password=PASSWORD,
                      extra=json.dumps({"sslmode": "verify-full", "connect_timeout": 7, "cursor": "realdict"}))
    parsed = psycopg2.extensions.parse_dsn(dsn_from_connection(conn))
    assert parsed == {"host": "db.example", "port": "6543", "dbname": "epochs", "user": "ar@oyo",
                      "password": PASSWORD, "sslmode": "verify-full", "connect_timeout": "7"}


def test_postgres_uri_connection_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT",
                       "postgresql://arroyo:pw%2F1@10.0.0.5:5433/arroyo_db?sslmode=require")
    parsed = psycopg2.extensions.parse_dsn(ArroyoHook().get_dsn())
    assert parsed == {"host": "10.0.0.5", "port": "5433", "dbname": "arroyo_db", "user": "arroyo",
                      "password": "pw/1", "sslmode": "require"}


@pytest.mark.parametrize(
    ("conn", "needle"),
    [
        (Connection(conn_id="c", conn_type="http", host="h"), "type 'http'"),
        (Connection(conn_id="c", conn_type="postgres", host=None), "no host"),
        (Connection(conn_id="c", conn_type="postgres", host="h", extra='{"iam": true}'), "iam"),
        (Connection(conn_id="c", conn_type="postgres", host="h", extra="not json"), "not valid JSON"),
    ],
)
def test_bad_connections_are_configuration_errors(conn: Connection, needle: str) -> None:
    with pytest.raises(ConfigurationError, match=needle):
        dsn_from_connection(conn)


def test_get_store_migrates_once_and_is_shared(monkeypatch: pytest.MonkeyPatch, pg_dsn: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", _with_password(pg_dsn, PASSWORD))
    migrations: list[list[int]] = []
    real_migrate = EpochStore.migrate

    def counting_migrate(self: EpochStore) -> list[int]:
        applied = real_migrate(self)
        migrations.append(applied)
        return applied

    monkeypatch.setattr(EpochStore, "migrate", counting_migrate)
    store = ArroyoHook().get_store()
    assert store.schema_version() == max(v for v, _, _ in available_migrations())
    assert ArroyoHook().get_store() is store
    assert ArroyoHook("arroyo_default").get_conn() is store
    assert migrations == [[v for v, _, _ in available_migrations()]]  # migrated once, on first use
    assert store.list_pipelines() == []
    assert caplog.records, "expected the hook and store to log something at DEBUG"
    for record in caplog.records:
        assert PASSWORD not in record.getMessage()
        assert "p%40ss" not in record.getMessage()
    assert PASSWORD not in repr(store) and "p%40ss" not in repr(store)


async def test_aget_store_is_async_and_shares_the_sync_store(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", pg_dsn)
    astore = await ArroyoHook().aget_store()
    assert isinstance(astore, AsyncEpochStore)
    assert astore.sync is ArroyoHook().get_store()
    astore.sync.register_pipeline("p1", stages=["s"], run_id="r1")
    assert (await astore.get_pipeline("p1")).run_id == "r1"
    assert (await astore.db_now()).tzinfo is not None


def test_permanent_failure_is_raised_at_once(monkeypatch: pytest.MonkeyPatch, pg_dsn: str) -> None:
    parts = urlsplit(pg_dsn)
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", urlunsplit(parts._replace(path="/no_such_database")))
    started = time.monotonic()
    with pytest.raises(StoreError) as info:
        ArroyoHook(retry_seconds=30).get_store()
    assert not isinstance(info.value, TransientStoreError)
    assert "no_such_database" in str(info.value)
    assert time.monotonic() - started < 10  # not retried for the 30 s budget


def test_transient_failure_is_retried_within_the_budget_then_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT",
                       _with_password(f"postgresql://arroyo@127.0.0.1:{port}/arroyo", PASSWORD))
    started = time.monotonic()
    with pytest.raises(TransientStoreError) as info:
        ArroyoHook(retry_seconds=1.0).get_store()
    elapsed = time.monotonic() - started
    assert 0.5 < elapsed < 10, elapsed  # retried for about the budget, then gave up
    assert "p@ss" not in str(info.value) and "p%40ss" not in str(info.value)


def test_test_connection_reports_the_schema_without_the_password(monkeypatch: pytest.MonkeyPatch,
                                                                  pg_dsn: str) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", _with_password(pg_dsn, PASSWORD))
    ok, message = ArroyoHook().test_connection()
    assert ok, message
    assert "schema version 0" in message  # test_connection does not migrate
    assert "p%40ss" not in message and PASSWORD not in message
    monkeypatch.setenv("AIRFLOW_CONN_ARROYO_DEFAULT", "postgresql://arroyo@127.0.0.1:1/arroyo")
    ok, message = ArroyoHook(retry_seconds=0.5).test_connection()
    assert not ok and "unreachable" in message
