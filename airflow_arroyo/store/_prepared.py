"""Statements prepared once per connection (``PREPARE`` / ``EXECUTE``): the controller's batch runs the
same few statements every tick, and PostgreSQL would otherwise parse and plan each one afresh (psycopg2
sends no prepared statements). A prepared statement lives as long as its session and is not undone by a
rollback, so remembering the names per connection object is exact; a connection the pool replaces
(after a server restart) starts with none.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgRawCursor

__all__ = ["Prepared", "execute_prepared"]

_NAME = re.compile(r"^arroyo_[a-z0-9_]+$")


@dataclass(frozen=True)
class Prepared:
    """One statement: ``sql`` uses ``$1``..``$n`` for the parameters of ``types`` (SQL type names)."""

    name: str
    types: tuple[str, ...]
    sql: str

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"prepared statement name {self.name!r}: use arroyo_ + lowercase letters, digits, _")


_lock = threading.Lock()
_prepared: weakref.WeakKeyDictionary[PgConnection, set[str]] = weakref.WeakKeyDictionary()


def execute_prepared(cur: PgRawCursor, statement: Prepared, params: Sequence[Any], *, prefix: str = "") -> None:
    """Execute ``statement`` with ``params`` on ``cur``'s connection, preparing it there the first time.
    ``prefix``: statements without parameters sent before it in the same round trip (``"BEGIN; "``)."""
    if len(params) != len(statement.types):
        raise ValueError(f"{statement.name}: {len(statement.types)} parameters expected, got {len(params)}")
    conn = cur.connection
    with _lock:
        names = _prepared.setdefault(conn, set())
    if statement.name not in names:
        cur.execute(f"PREPARE {statement.name}({', '.join(statement.types)}) AS {statement.sql}")
        names.add(statement.name)
    placeholders = ", ".join(["%s"] * len(params))
    cur.execute(f"{prefix}EXECUTE {statement.name}({placeholders})", tuple(params))
