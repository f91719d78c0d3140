"""Where the UI's epoch store comes from: the Airflow connection ``arroyo_default``.

The DSN is what :class:`~airflow_arroyo.hooks.arroyo.ArroyoHook` makes of the connection (an
``arroyo`` or ``postgres`` connection from any secrets backend, ``AIRFLOW_CONN_ARROYO_DEFAULT``
included), so the UI reads the same store as the triggers and operators. The UI never migrates the
schema. It reads on read-only connections; its one write, a person's verdict on a commit gate, goes through
a small store of its own (:meth:`StoreSource.writer`), opened on the first verdict.

Resolution is cached for ``ttl_s`` seconds (a changed connection is picked up within a minute); the
read-only pool is made once per DSN and closed when the DSN changes. Nothing is resolved at import
or at app start: a missing connection shows as a 503 page, not as an api-server that fails to start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.store import EpochStore, redact_dsn
from airflow_arroyo.store.reads import StoreReader

__all__ = ["DEFAULT_CONN_ID", "StoreSource", "resolve_dsn"]

log = logging.getLogger(__name__)

DEFAULT_CONN_ID = "arroyo_default"


def resolve_dsn(conn_id: str = DEFAULT_CONN_ID) -> str:
    """The epoch store's DSN from the Airflow connection ``conn_id`` (via the hook)."""
    from airflow.exceptions import AirflowNotFoundException

    from airflow_arroyo.hooks.arroyo import ArroyoHook

    try:
        return ArroyoHook(conn_id, migrate=False).get_dsn()
    except AirflowNotFoundException as exc:
        raise ConfigurationError(
            f"no epoch store configured for the Arroyo UI: there is no Airflow connection {conn_id!r}; "
            f"create it (type 'arroyo' or 'postgres', or e.g. AIRFLOW_CONN_{conn_id.upper()}="
            "'postgresql://user:pass@host:5432/db' in the api-server's environment)"
        ) from exc


def _writer(dsn: str) -> EpochStore:
    # verdicts are rare: two connections, and a short retry so that a click does not hang
    return EpochStore(dsn, max_connections=2, retry_seconds=5.0, application_name="airflow-arroyo-ui")


class StoreSource:
    """Gives the app its :class:`StoreReader`, resolving the DSN lazily and at most every ``ttl_s``."""

    def __init__(self, resolve: Callable[[], str] = resolve_dsn, *, ttl_s: float = 60.0,
                 factory: Callable[[str], StoreReader] = StoreReader,
                 clock: Callable[[], float] = time.monotonic,
                 writer_factory: Callable[[str], EpochStore] = _writer) -> None:
        self._resolve = resolve
        self._ttl_s = ttl_s
        self._factory = factory
        self._writer_factory = writer_factory
        self._clock = clock
        self._lock = threading.Lock()
        self._queries: StoreReader | None = None
        self._resolved_at: float | None = None
        self._writer: EpochStore | None = None

    def get(self) -> StoreReader:
        """The queries for the current DSN. Raises ConfigurationError when none is configured."""
        with self._lock:
            now = self._clock()
            fresh = self._resolved_at is not None and now - self._resolved_at < self._ttl_s
            if self._queries is not None and not self._queries.closed and fresh:
                return self._queries
            dsn = self._resolve()
            if self._queries is not None and self._queries.dsn == dsn and not self._queries.closed:
                self._resolved_at = now
                return self._queries
            if self._queries is not None:
                log.info("Arroyo UI: the epoch store changed to %s", redact_dsn(dsn))
                self._queries.close()
            self._queries = self._factory(dsn)
            self._resolved_at = now
            return self._queries

    def writer(self) -> EpochStore:
        """A store that can write, on the readers' DSN (for a verdict on a commit gate). Raises
        ConfigurationError when none is configured."""
        dsn = self.get().dsn
        with self._lock:
            if self._writer is not None and self._writer.dsn != dsn:
                self._writer.close()
                self._writer = None
            if self._writer is None:
                self._writer = self._writer_factory(dsn)
            return self._writer

    def reset(self) -> None:
        """Forget the resolved DSN and close the pools (the next request resolves again)."""
        with self._lock:
            if self._queries is not None:
                self._queries.close()
            if self._writer is not None:
                self._writer.close()
            self._queries = None
            self._writer = None
            self._resolved_at = None

    def close(self) -> None:
        """Close the reader, if one was opened."""
        self.reset()

