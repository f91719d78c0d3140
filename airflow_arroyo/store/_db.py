"""The database every part of the epoch store shares: the DSN, one connection pool, one retry policy, one
transaction shape.

Each concern of the store (:mod:`~airflow_arroyo.store.pipelines`, :mod:`~airflow_arroyo.store.epochs`, ...)
is a :class:`Concern` over one :class:`Database`; :class:`~airflow_arroyo.store.EpochStore` builds them all on
the same one, so they share its pool and its retry budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import psycopg2
import psycopg2.extensions
import psycopg2.extras
from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgRawCursor
from psycopg2.extras import RealDictCursor as PgCursor

from airflow_arroyo.core.exceptions import ConfigurationError, StoreError
from airflow_arroyo.store._pool import ConnectionPool
from airflow_arroyo.store._retry import call_with_retry

__all__ = ["Concern", "Database", "OnDatabase", "PgCursor", "dict_rows", "one", "positive_seconds", "redact_dsn"]

T = TypeVar("T")


class Database:
    """The epoch store's PostgreSQL: connections made with the store's settings, pooled, and every unit of
    work retried as a whole on transient errors. Thread-safe.

    ``read_only``: every connection refuses writes (``default_transaction_read_only``), what the store's readers
    (:class:`~airflow_arroyo.store.StoreReader`: the UI) use; ``statement_timeout_ms`` bounds each statement."""

    def __init__(self, dsn: str, *, max_connections: int, retry_seconds: float, application_name: str,
                 read_only: bool = False, statement_timeout_ms: int = 60_000) -> None:
        if not dsn:
            raise ConfigurationError("an epoch store DSN is required, e.g. postgresql://user@host:5432/db")
        self.dsn = dsn
        self.retry_seconds = retry_seconds
        self.application_name = application_name
        self.read_only = read_only
        self.statement_timeout_ms = int(statement_timeout_ms)
        self.pool = ConnectionPool(self.connect, max_connections)
        self.closed = False

    def connect(self) -> PgConnection:
        """A new connection with the store's settings (the pool's, and a listener's of its own)."""
        options = f"-c lock_timeout=15000 -c statement_timeout={self.statement_timeout_ms}"
        if self.read_only:
            options += " -c default_transaction_read_only=on"
        return psycopg2.connect(self.dsn, connect_timeout=5, application_name=self.application_name, options=options)

    @contextmanager
    def connection(self) -> Iterator[PgConnection]:
        with self.pool.connection() as conn:
            yield conn

    def retried(self, fn: Callable[[], T]) -> T:
        """``fn`` under the store's retry policy (it takes its own connection)."""
        return call_with_retry(fn, max_seconds=self.retry_seconds)

    def tx(self, fn: Callable[[PgCursor], T]) -> T:
        """Run ``fn`` in one transaction, retried as a whole on transient errors."""

        def attempt() -> T:
            with self.connection() as conn:
                with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
                    result = fn(cur)
                conn.commit()
                return result

        return self.retried(attempt)

    def read(self, fn: Callable[[PgCursor], T]) -> T:
        """Run ``fn`` in one ``REPEATABLE READ READ ONLY`` snapshot (a page that is consistent), retried as a whole
        on transient errors."""

        def attempt() -> T:
            with self.connection() as conn:
                if conn.status == psycopg2.extensions.STATUS_READY:
                    conn.set_session(isolation_level=psycopg2.extensions.ISOLATION_LEVEL_REPEATABLE_READ,
                                     readonly=True)
                with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
                    return fn(cur)

        return self.retried(attempt)

    def now(self) -> datetime:
        """The database's clock (every time the store writes is this clock's)."""

        def tx(cur: PgCursor) -> datetime:
            cur.execute("SELECT clock_timestamp() AS now")
            now: datetime = one(cur)["now"]
            return now

        return self.tx(tx)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool.close()


class OnDatabase:
    """A client of one :class:`Database` (the store, a reader): the settings it was made with, for callers that
    open another client like it."""

    _db: Database

    @property
    def dsn(self) -> str:
        """The epoch store's DSN."""
        return self._db.dsn

    @property
    def retry_seconds(self) -> float:
        """How long a unit of work retries transient errors."""
        return self._db.retry_seconds

    @property
    def application_name(self) -> str:
        """The connections' application name."""
        return self._db.application_name


class Concern:
    """One duty of the epoch store (its tables and their rules), over the :class:`Database` all share."""

    def __init__(self, db: Database) -> None:
        self._db = db


def redact_dsn(dsn: str) -> str:
    """The DSN without its password, for logs and error messages."""
    if "://" in dsn:
        parts = urlsplit(dsn)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return urlunsplit(parts._replace(netloc=netloc))
        return dsn
    return " ".join("password=***" if p.startswith("password=") else p for p in dsn.split())


def dict_rows(cur: PgRawCursor) -> list[dict[str, Any]]:
    """The rows of ``cur``'s result as dicts, built in C: a ``RealDictCursor`` builds each row in Python,
    column by column, which was the largest Python cost of a tick batch (the hot statements use a plain
    cursor and this)."""
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def one(cur: PgCursor) -> dict[str, Any]:
    """The one row the statement just run must have returned."""
    row = cur.fetchone()
    if row is None:
        raise StoreError("expected a row from the epoch store, got none")
    return dict(row)


def positive_seconds(value: object, name: str) -> None:
    """A duration in seconds from the user: a finite number above zero (NaN and infinity pass a
    plain ``<= 0`` test, and PostgreSQL orders NaN above every number)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number of seconds, got {value!r}")
