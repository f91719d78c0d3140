"""The Airflow hook of the epoch store.

Connection: type ``arroyo`` (its own form in the UI), or any ``postgres`` connection. Both carry
host, port, schema (the database), login, password and libpq options in ``extra`` (``sslmode``,
``sslrootcert``, ``connect_timeout``...). A URI works too, e.g. in the environment::

    AIRFLOW_CONN_ARROYO_DEFAULT='postgresql://arroyo:secret@db.example:5432/arroyo?sslmode=require'

The hook turns the connection into a DSN and hands out the store: :meth:`ArroyoHook.get_store`
(sync, for operators and DAG code) and :meth:`ArroyoHook.aget_store` (async, for triggers: the
connection is read with ``aget_connection`` and every store call runs in a worker thread). Stores are
shared per DSN and process, so that hundreds of triggers in one triggerer share one small
connection pool, and the schema is migrated (idempotently) the first time a process uses a DSN.
Retries are the store's: transient failures retried with bounded backoff, permanent ones raised
at once as :class:`~airflow_arroyo.core.exceptions.StoreError`. The password never reaches a log line.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING

from airflow.sdk import BaseHook

from airflow_arroyo import config
from airflow_arroyo.core.connections import extra_of, postgres_dsn
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError
from airflow_arroyo.store import AsyncEpochStore, EpochStore, redact_dsn

if TYPE_CHECKING:
    from airflow.sdk import Connection

__all__ = ["ArroyoHook", "dsn_from_connection"]

log = logging.getLogger(__name__)

ACCEPTED_CONN_TYPES = ("arroyo", "postgres", "postgresql")

def dsn_from_connection(conn: Connection) -> str:
    """A libpq URI for an ``arroyo`` or ``postgres`` Airflow connection. Pure; raises ConfigurationError."""
    conn_type = (conn.conn_type or "").lower()
    if conn_type not in ACCEPTED_CONN_TYPES:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} has type {conn.conn_type!r}; the epoch store needs an 'arroyo' "
            "or 'postgres' connection (host, port, database in 'schema', login, password)"
        )
    if not conn.host:
        raise ConfigurationError(
            f"connection {conn.conn_id!r} has no host; set it to the PostgreSQL server of the epoch store"
        )
    # Connection.extra is its JSON text, parsed here without extra_dejson's secret masking (which talks to
    # the supervisor synchronously, which an event loop must not do)
    extra = extra_of(conn.conn_id, conn.conn_type, conn.extra)
    return postgres_dsn(conn.conn_id, host=conn.host, port=conn.port, schema=conn.schema, login=conn.login,
                        password=conn.password, extra=extra)


# ---------------------------------------------------------------- process-wide stores

_stores: dict[tuple[str, int, float], EpochStore] = {}
_migrated: set[str] = set()
_stores_lock = threading.Lock()


def _shared_store(dsn: str, *, max_connections: int, retry_seconds: float, migrate: bool) -> EpochStore:
    """One store per (DSN, pool size, retry budget) and process; the schema migrated once per DSN."""
    key = (dsn, max_connections, retry_seconds)
    with _stores_lock:
        store = _stores.get(key)
        if store is None or store._closed:
            store = EpochStore(dsn, max_connections=max_connections, retry_seconds=retry_seconds,
                               application_name="airflow-arroyo-hook")
            _stores[key] = store
        if migrate and dsn not in _migrated:
            applied = store.migrate()
            if applied:
                log.info("epoch store %s: applied migrations %s", redact_dsn(dsn), applied)
            _migrated.add(dsn)
    return store


def _reset_shared_stores() -> None:
    """Close every shared store (tests; a process that forks)."""
    with _stores_lock:
        for store in _stores.values():
            store.close()
        _stores.clear()
        _migrated.clear()


class ArroyoHook(BaseHook):
    """The epoch store behind an Airflow connection.

    :param arroyo_conn_id: an ``arroyo`` or ``postgres`` connection (default ``[arroyo] conn_id``,
        itself ``arroyo_default`` by default).
    :param max_connections: size of the process-wide connection pool for this DSN.
    :param retry_seconds: how long transient store failures are retried before a
        :class:`~airflow_arroyo.core.exceptions.TransientStoreError`.
    :param migrate: apply missing schema migrations on first use (idempotent, safe concurrently).
    """

    conn_name_attr = "arroyo_conn_id"
    default_conn_name = "arroyo_default"
    conn_type = "arroyo"
    hook_name = "Arroyo epoch store"

    def __init__(self, arroyo_conn_id: str | None = None, *, max_connections: int = 8,
                 retry_seconds: float = 60.0, migrate: bool = True) -> None:
        super().__init__()
        if max_connections < 1:
            raise ConfigurationError(f"max_connections must be at least 1, got {max_connections!r}")
        if retry_seconds <= 0:
            raise ConfigurationError(f"retry_seconds must be positive, got {retry_seconds!r}")
        self.arroyo_conn_id = arroyo_conn_id or config.get("conn_id")
        self.max_connections = max_connections
        self.retry_seconds = retry_seconds
        self.migrate = migrate

    # The connection form (fields, labels, placeholders) is declared in the provider info
    # (``conn-fields`` / ``ui-field-behaviour``): ``get_ui_field_behaviour`` is deprecated since Airflow 3.2.

    # ------------------------------------------------------------------ sync

    def get_dsn(self) -> str:
        """The epoch store's DSN from the connection."""
        return dsn_from_connection(self.get_connection(self.arroyo_conn_id))

    def get_store(self) -> EpochStore:
        """The process-wide store for this connection, migrated on first use."""
        dsn = self.get_dsn()
        store = _shared_store(dsn, max_connections=self.max_connections, retry_seconds=self.retry_seconds,
                              migrate=self.migrate)
        log.debug("connection %s: epoch store %s", self.arroyo_conn_id, redact_dsn(dsn))
        return store

    def get_conn(self) -> EpochStore:
        """Airflow: the hook's client, the epoch store."""
        return self.get_store()

    def test_connection(self) -> tuple[bool, str]:
        """For the UI's "Test" button: reach the server and report the schema version."""
        try:
            dsn = self.get_dsn()
            store = EpochStore(dsn, max_connections=1, retry_seconds=min(self.retry_seconds, 5.0),
                               application_name="airflow-arroyo-test")
            try:
                version = store.check_schema(complete=False)  # the hook migrates on first use
            finally:
                store.close()
        except ArroyoError as exc:
            return False, str(exc)
        return True, f"reached the epoch store at {redact_dsn(dsn)}; schema version {version}"

    # ------------------------------------------------------------------ async (triggers)

    async def aget_dsn(self) -> str:
        """The epoch store's DSN from the connection, without blocking the event loop."""
        conn = await self.aget_connection(self.arroyo_conn_id)
        return dsn_from_connection(conn)

    async def aget_store(self) -> AsyncEpochStore:
        """The async twin of :meth:`get_store`; never blocks the event loop."""
        dsn = await self.aget_dsn()
        store = await asyncio.to_thread(_shared_store, dsn, max_connections=self.max_connections,
                                        retry_seconds=self.retry_seconds, migrate=self.migrate)
        return AsyncEpochStore(store)
