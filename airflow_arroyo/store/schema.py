"""The store's schema: applying the migrations this release ships, and checking that a database has them."""

from __future__ import annotations

from airflow_arroyo.store import _migrate
from airflow_arroyo.store._db import Concern, redact_dsn

__all__ = ["Schema"]


class Schema(Concern):
    """Migrations (``migrations/NNNN_*.sql``) and the version check every command runs first."""

    def migrate(self) -> list[int]:
        """Apply missing migrations; return the versions applied now (idempotent)."""

        def attempt() -> list[int]:
            with self._db.connection() as conn:
                return _migrate.apply_migrations(conn)

        return self._db.retried(attempt)

    def check_schema(self, *, complete: bool = True) -> int:
        """The schema version after checking that it is the one this release ships (not newer, unedited
        and, with ``complete``, fully applied); raises :class:`SchemaError` (:class:`SchemaMissingError`
        when ``airflow-arroyo migrate`` fixes it) saying what to run otherwise.
        Read-only."""

        def attempt() -> int:
            with self._db.connection() as conn:
                return _migrate.check_schema(conn, complete=complete, where=redact_dsn(self._db.dsn))

        return self._db.retried(attempt)

    def schema_version(self) -> int:
        """The newest migration applied to the database (0: none)."""

        def attempt() -> int:
            with self._db.connection() as conn:
                return _migrate.current_version(conn)

        return self._db.retried(attempt)
