"""Versioned schema migrations, applied idempotently and safely from several processes at once.

Each applied migration is recorded with the SHA-256 of its text. Before applying anything (and in
:func:`check_schema`, which every process that only uses the store may call at start), the recorded
migrations are compared with the shipped ones: a database with a migration this code does not ship
(written by a newer airflow-arroyo) or with a migration whose text differs from the shipped one (an
edited migration, a fork) is refused with :class:`~airflow_arroyo.core.exceptions.SchemaError`, before
anything is written. Rows recorded before checksums existed get theirs on the next migrate.
"""

from __future__ import annotations

import hashlib
import logging
import re
from importlib import resources

from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgRawCursor

from airflow_arroyo.core.exceptions import SchemaError, SchemaMissingError

log = logging.getLogger(__name__)

_LOCK_KEY = 0x41_72_72_6F_79_6F  # "Arroyo": the advisory lock that serialises migrations
_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


def available_migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every migration shipped with the package, in order."""
    out: list[tuple[int, str, str]] = []
    folder = resources.files("airflow_arroyo.store").joinpath("migrations")
    for entry in folder.iterdir():
        m = _NAME.match(entry.name)
        if m:
            out.append((int(m.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    return sorted(out)


def checksum(sql: str) -> str:
    """The recorded fingerprint of a migration's text."""
    return hashlib.sha256(sql.encode("utf-8")).hexdigest()


def _recorded(cur: PgRawCursor, *, with_checksums: bool = True) -> dict[int, tuple[str, str | None]]:
    """The migrations applied to this database: version -> (name, checksum or None)."""
    column = "checksum" if with_checksums else "NULL::text"
    cur.execute(f"SELECT version, name, {column} FROM arroyo_schema_migrations")  # noqa: S608 - constant
    return {int(v): (str(n), c) for v, n, c in cur.fetchall()}


def _verify(recorded: dict[int, tuple[str, str | None]]) -> None:
    """Refuse a schema that this code did not write: newer migrations, or a different text."""
    shipped = {v: (name, checksum(sql)) for v, name, sql in available_migrations()}
    newer = sorted(set(recorded) - set(shipped))
    if newer:
        names = ", ".join(recorded[v][0] for v in newer)
        raise SchemaError(
            f"the epoch store's schema has migration(s) {names}, which this airflow-arroyo does not ship "
            f"(it knows up to version {max(shipped)}): the database was migrated by a newer release; "
            "upgrade airflow-arroyo here (every process that uses one epoch store must run the same release)"
        )
    for version, (name, recorded_sum) in sorted(recorded.items()):
        if recorded_sum is not None and recorded_sum != shipped[version][1]:
            raise SchemaError(
                f"migration {name} applied to this epoch store differs from the one shipped with this "
                f"airflow-arroyo (recorded sha256 {recorded_sum[:12]}..., shipped {shipped[version][1][:12]}...): "
                "the migration was edited after it was applied, or another build of airflow-arroyo migrated "
                "this database; use the release that migrated it, or restore the shipped migration"
            )


def apply_migrations(conn: PgConnection) -> list[int]:
    """Apply the missing migrations in one transaction each; return the versions applied now.

    Raises :class:`SchemaError` (writing nothing) when the database's schema is not one this code
    wrote (see the module docstring)."""
    applied_now: list[int] = []
    with conn, conn.cursor() as cur:
        cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
        cur.execute(
            "CREATE TABLE IF NOT EXISTS arroyo_schema_migrations ("
            " version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cur.execute("ALTER TABLE arroyo_schema_migrations ADD COLUMN IF NOT EXISTS checksum text")
        recorded = _recorded(cur)
        _verify(recorded)
        for version, name, sql in available_migrations():
            if version in recorded:
                if recorded[version][1] is None:  # applied before checksums were recorded
                    cur.execute("UPDATE arroyo_schema_migrations SET checksum = %s WHERE version = %s",
                                (checksum(sql), version))
                continue
            log.info("epoch store: applying migration %s", name)
            cur.execute(sql)
            cur.execute("INSERT INTO arroyo_schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                        (version, name, checksum(sql)))
            applied_now.append(version)
    return applied_now


def check_schema(conn: PgConnection, *, complete: bool = True, where: str = "") -> int:
    """The schema version, once it is known to be the one this code ships (and, with ``complete``,
    fully applied); read-only.

    Raises :class:`SchemaError` naming what to do: a newer schema, a migration whose text differs,
    and with ``complete`` :class:`SchemaMissingError` for no schema or missing migrations (run
    ``airflow-arroyo migrate``). ``where`` (a redacted DSN) goes into the message."""
    want = max((v for v, _, _ in available_migrations()), default=0)
    with conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('arroyo_schema_migrations') IS NOT NULL")
        row = cur.fetchone()
        if not row or not row[0]:
            if not complete:
                return 0
            raise SchemaMissingError(0, want, where)
        cur.execute("SELECT column_name FROM information_schema.columns"
                    " WHERE table_name = 'arroyo_schema_migrations' AND column_name = 'checksum'"
                    " AND table_schema = current_schema()")
        # a table written before checksums were recorded has versions only
        recorded = _recorded(cur, with_checksums=cur.fetchone() is not None)
    _verify(recorded)
    missing = [name for v, name, _ in available_migrations() if v not in recorded]
    if missing and complete:
        raise SchemaMissingError(max(recorded, default=0), want, where, missing=", ".join(missing))
    return max(recorded, default=0)


def current_version(conn: PgConnection) -> int:
    with conn, conn.cursor() as cur:
        cur.execute("SELECT to_regclass('arroyo_schema_migrations') IS NOT NULL")
        row = cur.fetchone()
        if not row or not row[0]:
            return 0
        cur.execute("SELECT COALESCE(max(version), 0) FROM arroyo_schema_migrations")
        r = cur.fetchone()
        return int(r[0]) if r else 0
