"""A small thread-safe connection pool: reuse idle connections, forget them all when one broke.

psycopg2's own pools do not fit: they keep at most ``minconn`` idle connections (``minconn=0``
reuses nothing, a server process per call) and connect ``minconn`` times in their constructor
(outside any retry); and after a server restart they hand out every dead idle connection in turn,
each costing the caller a failed attempt and a back-off. Here a connection that broke (the server
restarted, the network dropped) discards every idle one with it, so the retry connects afresh.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import psycopg2
from psycopg2.extensions import TRANSACTION_STATUS_IDLE
from psycopg2.extensions import connection as PgConnection

from airflow_arroyo.core.exceptions import StoreError

__all__ = ["ConnectionPool"]


class ConnectionPool:
    """At most ``size`` connections in use at once (callers wait for a slot) and at most ``size``
    kept idle; connections are made on demand by ``connect``, never in the constructor."""

    def __init__(self, connect: Callable[[], PgConnection], size: int) -> None:
        if size < 1:
            raise ValueError(f"pool size must be at least 1, got {size}")
        self._connect = connect
        self._size = size
        self._idle: list[PgConnection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False

    @property
    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    @contextmanager
    def connection(self) -> Iterator[PgConnection]:
        """A connection for one unit of work; rolled back and kept (or closed, if it broke) after."""
        self._slots.acquire()
        conn: PgConnection | None = None
        broken = False
        try:
            conn = self._get()
            yield conn
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            broken = True
            raise
        finally:
            if conn is not None:
                self._put(conn, broken)
            self._slots.release()

    def _get(self) -> PgConnection:
        with self._lock:
            if self._closed:
                raise StoreError("the epoch store client was closed; create a new one")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _put(self, conn: PgConnection, broken: bool) -> None:
        if not broken and not conn.closed:
            try:
                conn.rollback()
                broken = conn.info.transaction_status != TRANSACTION_STATUS_IDLE
            except psycopg2.Error:
                broken = True
        if broken or conn.closed:
            close_quietly(conn)
            # the server most likely restarted: the idle connections are dead as well
            self.discard_idle()
            return
        with self._lock:
            if not self._closed and len(self._idle) < self._size:
                self._idle.append(conn)
                return
        close_quietly(conn)

    def discard_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            close_quietly(conn)

    def close(self) -> None:
        """Close the idle connections now and the ones in use when they come back."""
        with self._lock:
            self._closed = True
        self.discard_idle()


def close_quietly(conn: PgConnection | None) -> None:
    """Close ``conn`` (if any), ignoring a connection that is already broken."""
    if conn is not None:
        with suppress(psycopg2.Error):
            conn.close()
