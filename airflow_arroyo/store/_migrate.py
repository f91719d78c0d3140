"""Versioned schema migrations, applied idempotently and safely from several processes at once."""

from __future__ import annotations

import logging
import re
from importlib import resources

from psycopg2.extensions import connection as PgConnection

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


def apply_migrations(conn: PgConnection) -> list[int]:
    """Apply the missing migrations in one transaction each; return the versions applied now."""
    applied_now: list[int] = []
    with conn:
        with conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            cur.execute(
                "CREATE TABLE IF NOT EXISTS arroyo_schema_migrations ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            )
            cur.execute("SELECT version FROM arroyo_schema_migrations")
            done = {int(r[0]) for r in cur.fetchall()}
            for version, name, sql in available_migrations():
                if version in done:
                    continue
                log.info("epoch store: applying migration %s", name)
                cur.execute(sql)
                cur.execute("INSERT INTO arroyo_schema_migrations (version, name) VALUES (%s, %s)",
                            (version, name))
                applied_now.append(version)
    return applied_now


def current_version(conn: PgConnection) -> int:
    with conn:
        with conn.cursor() as cur:
            cur.execute("SELECT to_regclass('arroyo_schema_migrations') IS NOT NULL")
            row = cur.fetchone()
            if not row or not row[0]:
                return 0
            cur.execute("SELECT COALESCE(max(version), 0) FROM arroyo_schema_migrations")
            r = cur.fetchone()
            return int(r[0]) if r else 0
