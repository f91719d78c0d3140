"""An exactly-once PostgreSQL sink: a two-phase commit over epochs, recorded in the target database.

The shape is Flink's two-phase-commit sink (``TwoPhaseCommitSinkFunction``), like the file sink
(:mod:`~airflow_arroyo.runtime.sinks.files`): a micro-batch is *pre-committed* where readers cannot see
it, and *committed* into the target table when an epoch whose cut covers it completes; a restore rolls
the table back to the restored epoch's cut. The target database need not be the epoch store's.

Tables, all in the target table's schema (``<h>`` is a hash of pipeline and sink)::

    arroyo_sink_progress        (pipeline_id, sink) -> target table, committed_batch   one row per sink
    arroyo_sink_pending_<h>     the target's columns + _arroyo_batch, _arroyo_part, _arroyo_seq
    arroyo_sink_undo_<h>        upsert only: pre-images, the target's columns + _arroyo_batch, _arroyo_existed

* **Pre-commit** (micro-batch *b*, from the executors): the driver deletes what an earlier attempt of
  *b* staged; every partition then writes its rows into the pending table in one transaction of its own
  that first deletes that partition's earlier attempt (a retried Spark task does not stage twice).
* **Commit** (the driver, when an epoch with sink cut *c* completes): ONE transaction in the target
  database locks the sink's progress row and, if ``committed_batch < c``, applies batches
  ``(committed_batch, c]`` in order and sets ``committed_batch = c``. A commit cut short by a crash
  rolled back as a whole; the next one finishes it, never repeats it.

  - ``append``: inserts the staged rows; they stay in the pending table as the journal a rollback
    deletes by.
  - ``upsert`` (``key=(...)``, a PRIMARY KEY or UNIQUE constraint of the table): batch by batch, it
    records the pre-image of every key the batch touches, then ``INSERT ... ON CONFLICT (key) DO
    UPDATE`` with the batch's last row per key (Spark's update output mode).
* **Rollback** (restore of epoch *N*, sink cut *r*): in one transaction, finish the commit through *r*
  (*N* completed; its commit may not have run), then undo batches after *r*: ``append`` deletes, for
  every distinct journal row, as many equal rows of the table as were inserted; ``upsert`` puts back,
  per key, the pre-image before the first undone batch (deleting keys that did not exist). Pending
  rows after *r* are dropped.
* **Trim**: journal rows and pre-images of batches at or before the cut of the oldest completed epoch
  are deleted after a commit: no restore can go behind that epoch. The progress row records how far
  (``trimmed_batch``; NULL on a row older than the column: unknown). A shadow run's sink
  (``keep_journal=True``) trims nothing: a shadow compare reads what each epoch committed from the journal
  (:func:`shadow_window_rows`).

Readers of the target table see only committed epochs: nothing reaches it outside a commit or a
rollback transaction.

Fencing: the progress row also holds ``generation``, the fencing token of the newest run that claimed
or rolled back the sink (taken in that transaction). Every pre-commit (the driver's clearing and each
partition's transaction, which share-locks the row), every commit, rollback and trim (which lock it) first
compares it with its own and refuses with :class:`~airflow_arroyo.core.exceptions.FencedError` when a newer
run took over: a superseded run that is still alive can neither stage, commit nor trim anything once the
newer run claimed or rolled back the sink (its first write to the sink, before its queries start). A trim
needs it too: a run stalled between its commit and its trim would trim through a batch id of its own,
which a newer run that restored an older epoch re-uses for new batches, deleting the journal (or the
pre-images) a later restore of that epoch needs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import psycopg2
import psycopg2.extras
from psycopg2 import sql

from airflow_arroyo.core.connections import dsn_from_env_value
from airflow_arroyo.core.exceptions import ConfigurationError, FencedError
from airflow_arroyo.runtime.sinks.base import SinkCommit
from airflow_arroyo.store import FencingToken, redact_dsn, retrying

if TYPE_CHECKING:
    from psycopg2.extensions import connection as PgConnection
    from psycopg2.extras import RealDictCursor as PgCursor
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["BatchWindow", "PostgresTarget", "TransactionalPostgresSink", "shadow_window_rows"]

log = logging.getLogger(__name__)

PostgresMode = Literal["append", "upsert"]
_MODES = ("append", "upsert")
_BATCH, _PART, _SEQ, _EXISTED = "_arroyo_batch", "_arroyo_part", "_arroyo_seq", "_arroyo_existed"
_PROGRESS = "arroyo_sink_progress"
_PENDING_COLUMNS = f"ADD COLUMN {_BATCH} bigint, ADD COLUMN {_PART} int, ADD COLUMN {_SEQ} int"
_UNDO_COLUMNS = f"ADD COLUMN {_BATCH} bigint, ADD COLUMN {_EXISTED} boolean"
_LOCK_KEY = 0x41_72_72_6F_79_73  # serialises creating the sink tables across processes

# Spark type name -> PostgreSQL types (pg_type.typname) its values can be written to without loss.
_INTS = {"int2", "int4", "int8", "numeric", "float4", "float8"}
_COMPATIBLE: dict[str, set[str]] = {
    "ByteType": _INTS,
    "ShortType": _INTS,
    "IntegerType": {"int4", "int8", "numeric", "float8"},
    "LongType": {"int8", "numeric"},
    "FloatType": {"float4", "float8", "numeric"},
    "DoubleType": {"float8", "numeric"},
    "DecimalType": {"numeric"},
    "StringType": {"text", "varchar", "bpchar", "citext", "name", "uuid", "json", "jsonb"},
    "VarcharType": {"text", "varchar", "bpchar", "citext"},
    "CharType": {"text", "varchar", "bpchar", "citext"},
    "BooleanType": {"bool"},
    "DateType": {"date", "timestamp", "timestamptz"},
    "TimestampType": {"timestamptz", "timestamp"},
    "TimestampNTZType": {"timestamp"},
    "BinaryType": {"bytea"},
}


@dataclass(frozen=True)
class PostgresTarget:
    """Where a PostgreSQL sink writes: ``table`` (``schema.table`` or ``table``), in the database given by
    exactly one of ``dsn``, ``dsn_env`` (the name of an environment variable holding the DSN: keeps it off
    command lines) or ``conn_id`` (an Airflow connection, read from ``AIRFLOW_CONN_<CONN_ID>`` in the
    driver's environment, URI or JSON form: the driver does not import Airflow).

    ``mode="append"`` inserts every row; ``mode="upsert"`` with ``key=(...)`` (a PRIMARY KEY or UNIQUE
    constraint of the table) keeps the last row per key, for aggregates in Spark's update output mode.
    """

    table: str
    dsn: str | None = field(default=None, repr=False)
    dsn_env: str | None = None
    conn_id: str | None = None
    mode: PostgresMode = "append"
    key: Sequence[str] = ()
    #: keep the journal and the pre-images of every committed batch (a trim forgets nothing): set on a shadow
    #: run's sinks (:func:`airflow_arroyo.core.shadow.shadow_pipeline`) so that each epoch's rows stay comparable
    keep_journal: bool = False

    def problem(self) -> str | None:
        """What is wrong with this target (without connecting), or ``None``."""
        given = [n for n in ("dsn", "dsn_env", "conn_id") if getattr(self, n)]
        if len(given) != 1:
            return ("give exactly one of dsn='postgresql://...', dsn_env='<ENV VAR holding the DSN>' or "
                    f"conn_id='<Airflow connection id>' (got {', '.join(given) or 'none'})")
        if not isinstance(self.table, str) or not self.table.strip():
            return "table must name a table, e.g. table='public.totals'"
        if self.mode not in _MODES:
            return f"mode must be 'append' or 'upsert', got {self.mode!r}"
        if self.mode == "upsert" and not self.key:
            return "mode='upsert' needs key=('<column>', ...): the table's PRIMARY KEY or UNIQUE columns"
        if self.mode == "append" and self.key:
            return "key=... is for mode='upsert'; an append sink inserts every row"
        if isinstance(self.key, str):
            return f"key must be a sequence of column names, e.g. key=({self.key!r},)"
        return None

    def resolve_dsn(self) -> str:
        """The DSN, read where this target says (environment variables are read in the calling process)."""
        if self.dsn:
            return self.dsn
        if self.dsn_env:
            value = os.environ.get(self.dsn_env)
            if not value:
                raise ConfigurationError(f"postgres sink on {self.table!r}: environment variable {self.dsn_env} "
                                         "is not set; set it to the target database's DSN in the driver's environment")
            return value
        assert self.conn_id
        var = f"AIRFLOW_CONN_{self.conn_id.upper()}"
        value = os.environ.get(var)
        if not value:
            raise ConfigurationError(
                f"postgres sink on {self.table!r}: connection {self.conn_id!r} is not in the driver's environment; "
                f"set {var} (a postgresql:// URI or the connection's JSON) where the driver runs"
            )
        return dsn_from_env_value(value, var)


@dataclass(frozen=True)
class _Column:
    name: str
    typname: str
    category: str
    not_null: bool
    has_default: bool


class TransactionalPostgresSink:
    """The PostgreSQL side of one sink stage (see the module docstring)."""

    def __init__(self, pipeline_id: str, stage: str, target: PostgresTarget) -> None:
        problem = target.problem()
        if problem:
            raise ConfigurationError(f"sink {stage!r}: {problem}")
        self.pipeline_id = pipeline_id
        self.stage = stage
        self.target = target
        self.mode = target.mode
        self.key = list(target.key)
        self._dsn: str | None = None
        h = hashlib.sha256(f"{pipeline_id}\0{stage}".encode()).hexdigest()[:16]
        self._pending_name = f"arroyo_sink_pending_{h}"
        self._undo_name = f"arroyo_sink_undo_{h}"
        self._schema: str | None = None
        self._table: str | None = None
        self._columns: list[_Column] | None = None
        self._checked_schema: StructType | None = None
        self.token: FencingToken | None = None  # the run's fencing token (set by the driver before any write)

    @property
    def generation(self) -> int:
        """The fencing generation this sink writes with (0 without a token)."""
        return self.token.generation if self.token is not None else 0

    def __repr__(self) -> str:
        return f"TransactionalPostgresSink({self.pipeline_id}/{self.stage} -> {self.target.table}, {self.mode})"

    @property
    def uri(self) -> str:
        """Where it writes, without credentials."""
        return f"{redact_dsn(self.dsn)}#{self.target.table}"

    @property
    def dsn(self) -> str:
        """The target database's DSN, resolved once."""
        if self._dsn is None:
            self._dsn = self.target.resolve_dsn()
        return self._dsn

    # ------------------------------------------------------------------ connections

    def _run(self, fn: Any, *, what: str) -> Any:
        """Run ``fn(cursor)`` in one transaction, retried on transient errors with the store's policy."""

        def attempt() -> Any:
            conn: PgConnection = psycopg2.connect(self.dsn, application_name=f"arroyo-sink-{self.stage}")
            try:
                with conn, conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur:
                    return fn(cur)
            finally:
                conn.close()

        try:
            return retrying()(attempt)
        except psycopg2.Error as exc:  # a FencedError is no psycopg2 error: it passes through as it is
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigurationError(
                f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: {what} on {self.target.table!r} failed: {first}"
            ) from exc

    # ------------------------------------------------------------------ the table

    def _describe(self, cur: PgCursor) -> None:
        cur.execute("SELECT to_regclass(%s)::oid AS oid", (self.target.table,))
        row = cur.fetchone()
        if row is None or row["oid"] is None:
            raise ConfigurationError(
                f"sink {self.stage!r}: table {self.target.table!r} does not exist in {redact_dsn(self.dsn)}; create "
                "it first (the sink never creates or alters the target table)"
            )
        oid = row["oid"]
        cur.execute("SELECT n.nspname, c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.oid = %s", (oid,))
        names = cur.fetchone()
        assert names is not None
        self._schema, self._table = names["nspname"], names["relname"]
        cur.execute(
            "SELECT a.attname, t.typname, t.typcategory, a.attnotnull, a.atthasdef FROM pg_attribute a "
            "JOIN pg_type t ON t.oid = a.atttypid WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped "
            "ORDER BY a.attnum", (oid,))
        self._columns = [_Column(r["attname"], r["typname"], r["typcategory"], r["attnotnull"], r["atthasdef"])
                         for r in cur.fetchall()]
        names_ = {c.name for c in self._columns}
        for k in self.key:
            if k not in names_:
                raise ConfigurationError(f"sink {self.stage!r}: key column {k!r} is not a column of "
                                         f"{self.target.table!r} (columns: {', '.join(sorted(names_))})")
        if self.mode == "upsert":
            cur.execute(
                "SELECT array_agg(a.attname::text) AS cols FROM pg_index i JOIN pg_attribute a "
                "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisunique "
                "AND i.indpred IS NULL GROUP BY i.indexrelid", (oid,))
            uniques = [set(r["cols"]) for r in cur.fetchall()]
            if set(self.key) not in uniques:
                raise ConfigurationError(
                    f"sink {self.stage!r}: mode='upsert' on key {tuple(self.key)} needs a PRIMARY KEY or UNIQUE "
                    f"constraint on exactly those columns of {self.target.table!r}; add one (ALTER TABLE ... ADD "
                    "UNIQUE (...)) or give key= the columns of an existing one"
                )

    def _ident(self, name: str) -> sql.Composable:
        return sql.Identifier(self._schema or "public", name)

    @property
    def _target(self) -> sql.Composable:
        assert self._table is not None
        return self._ident(self._table)

    def _owner_problem(self, cur: PgCursor) -> str | None:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present", (self._ident(_PROGRESS).as_string(cur),))
        row = cur.fetchone()
        if not row or not row["present"]:
            return None
        cur.execute(sql.SQL("SELECT pipeline_id, sink FROM {} WHERE target = %s AND (pipeline_id, sink) <> (%s, %s)")
                    .format(self._ident(_PROGRESS)), (self._table, self.pipeline_id, self.stage))
        other = cur.fetchone()
        if other is None:
            return None
        return (f"table {self.target.table!r} is written by sink {other['sink']!r} of pipeline "
                f"{other['pipeline_id']!r}; one table has one exactly-once writer: give this sink another table")

    def check_writable(self) -> None:
        """Read-only, before anything is written or rolled back: the table exists, the key is a unique key, and
        no other sink writes the table."""

        def tx(cur: PgCursor) -> None:
            self._describe(cur)
            problem = self._owner_problem(cur)
            if problem:
                raise ConfigurationError(f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: {problem}")

        self._run(tx, what="checking the target")

    def claim(self) -> None:
        """Create the sink's own tables (once) and its progress row; record this sink as the table's writer."""

        def tx(cur: PgCursor) -> None:
            self._describe(cur)
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
            problem = self._owner_problem(cur)
            if problem:
                raise ConfigurationError(f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: {problem}")
            cur.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (pipeline_id text NOT NULL, sink text NOT NULL, target text NOT NULL, "
                "mode text NOT NULL, committed_batch bigint NOT NULL DEFAULT -1, "
                "updated_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (pipeline_id, sink))"
            ).format(self._ident(_PROGRESS)))
            # how far a trim went (NULL on rows from before the column: unknown); a new row has trimmed nothing.
            # Added only when missing: an ALTER locks the table every sink of the schema shares
            cur.execute("SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass(%s) "
                        "AND attname = 'trimmed_batch' AND NOT attisdropped) AS present",
                        (self._ident(_PROGRESS).as_string(cur),))
            has_column = cur.fetchone()
            if not (has_column and has_column["present"]):
                cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS trimmed_batch bigint")
                            .format(self._ident(_PROGRESS)))
            cur.execute(sql.SQL("INSERT INTO {} (pipeline_id, sink, target, mode, trimmed_batch) "
                                "VALUES (%s, %s, %s, %s, -1) ON CONFLICT (pipeline_id, sink) DO NOTHING")
                        .format(self._ident(_PROGRESS)), (self.pipeline_id, self.stage, self._table, self.mode))
            self._fence(cur, take=True, what="claiming the sink")
            # Copies of the target's columns without its constraints (a pre-image of a missing key is NULLs).
            for name, extra in ((self._pending_name, _PENDING_COLUMNS), (self._undo_name, _UNDO_COLUMNS)):
                cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present", (self._ident(name).as_string(cur),))
                present = cur.fetchone()
                if present and present["present"]:
                    continue
                cur.execute(sql.SQL("CREATE TABLE {} AS SELECT * FROM {} WITH NO DATA")
                            .format(self._ident(name), self._target))
                cur.execute(sql.SQL("ALTER TABLE {} " + extra).format(self._ident(name)))
                cur.execute(sql.SQL("CREATE INDEX ON {} ({})").format(self._ident(name), sql.Identifier(_BATCH)))

        self._run(tx, what="preparing the sink tables")

    def _fence_sql(self, lock: Literal["SHARE", "UPDATE"]) -> sql.Composable:
        return sql.SQL("SELECT generation FROM {} WHERE pipeline_id = %s AND sink = %s FOR {}").format(
            self._ident(_PROGRESS), sql.SQL(lock))

    def _fence(self, cur: PgCursor, *, take: bool, what: str) -> None:
        """Fencing: refuse when a newer run's generation is recorded on the progress row; with ``take``
        (claim, rollback), record this run's (the row stays locked until the transaction ends)."""
        if not self.generation:
            return  # no token: a sink used outside a driver (tests, tools)
        if take:  # progress tables created before fencing have no generation column yet
            cur.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS generation bigint NOT NULL DEFAULT 0")
                        .format(self._ident(_PROGRESS)))
        cur.execute(self._fence_sql("UPDATE" if take else "SHARE"), (self.pipeline_id, self.stage))
        row = cur.fetchone()
        if row is None:
            return
        recorded = int(row["generation"])
        if recorded > self.generation:
            token = self.token
            raise FencedError(self.pipeline_id, token.run_id if token else None, self.generation,
                              by_generation=recorded, what=f"{what} of sink {self.stage!r} ({self.target.table})")
        if take and recorded < self.generation:
            cur.execute(sql.SQL("UPDATE {} SET generation = %s WHERE pipeline_id = %s AND sink = %s").format(
                self._ident(_PROGRESS)), (self.generation, self.pipeline_id, self.stage))

    def _progress(self, cur: PgCursor, *, lock: bool) -> int | None:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present", (self._ident(_PROGRESS).as_string(cur),))
        row = cur.fetchone()
        if not row or not row["present"]:
            return None
        query = sql.SQL("SELECT committed_batch FROM {} WHERE pipeline_id = %s AND sink = %s").format(
            self._ident(_PROGRESS))
        cur.execute(query + sql.SQL(" FOR UPDATE") if lock else query, (self.pipeline_id, self.stage))
        row = cur.fetchone()
        return None if row is None else int(row["committed_batch"])

    def has_state(self) -> bool:
        """True if the target holds staged or committed batches of this sink."""
        def tx(cur: PgCursor) -> bool:
            self._describe(cur)
            committed = self._progress(cur, lock=False)
            if committed is None:
                return False
            if committed >= 0:
                return True
            cur.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {}) AS any").format(self._ident(self._pending_name)))
            row = cur.fetchone()
            return bool(row and row["any"])

        return bool(self._run(tx, what="reading the sink's progress"))

    def committed_batch(self) -> int | None:
        """The last micro-batch committed into the table (``-1``: none), ``None`` before the first claim."""

        def tx(cur: PgCursor) -> int | None:
            self._describe(cur)
            return self._progress(cur, lock=False)

        result: int | None = self._run(tx, what="reading the sink's progress")
        return result

    # ------------------------------------------------------------------ pre-commit

    def check_schema(self, schema: StructType) -> None:
        """Every output column is a column of the table of a compatible type; table columns the output lacks
        are nullable or have a default. Raises :class:`ConfigurationError` naming the column."""
        assert self._columns is not None
        by_name = {c.name: c for c in self._columns}
        problems = []
        for f in schema.fields:
            col = by_name.get(f.name)
            if col is None:
                problems.append(f"output column {f.name!r} is not a column of {self.target.table!r}")
                continue
            spark_type = type(f.dataType).__name__
            ok = col.category == "A" if spark_type == "ArrayType" else col.typname in _COMPATIBLE.get(spark_type, set())
            if not ok:
                problems.append(f"column {f.name!r}: the output is {f.dataType.simpleString()} but the table's column "
                                f"is {col.typname}")
        given = {f.name for f in schema.fields}
        for c in self._columns:
            if c.name not in given and c.not_null and not c.has_default:
                problems.append(f"column {c.name!r} of {self.target.table!r} is NOT NULL without a default and the "
                                "output has no such column")
        if self.mode == "upsert":
            problems += [f"key column {k!r} is not in the output" for k in self.key if k not in given]
        if problems:
            raise ConfigurationError(f"sink {self.stage!r} of pipeline {self.pipeline_id!r} cannot write "
                                     f"{self.target.table!r}: " + "; ".join(problems) + "; fix the sink's transform "
                                     "or the table")

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit micro-batch ``batch_id`` from the executors (replaces an earlier attempt of it)."""
        if self._columns is None:
            self._run(self._describe, what="reading the target's columns")
        if self._checked_schema != df.schema:
            self.check_schema(df.schema)  # before any write
            self._checked_schema = df.schema
        names = [f.name for f in df.schema.fields]
        assert self._columns is not None
        by_name = {c.name: c for c in self._columns}
        not_null = [i for i, n in enumerate(names) if by_name[n].not_null]

        insert = sql.SQL("INSERT INTO {} ({}) VALUES %s").format(
            self._ident(self._pending_name), sql.SQL(", ").join(map(sql.Identifier, [_BATCH, _PART, _SEQ, *names])))
        delete = sql.SQL("DELETE FROM {} WHERE {} = %s AND {} = %s").format(
            self._ident(self._pending_name), sql.Identifier(_BATCH), sql.Identifier(_PART))

        def clear(cur: PgCursor) -> tuple[str, str, str]:
            committed = self._progress(cur, lock=False)
            self._fence(cur, take=False, what=f"the pre-commit of micro-batch {batch_id}")
            if committed is not None and batch_id <= committed:
                raise ConfigurationError(
                    f"sink {self.stage!r}: micro-batch {batch_id} is already committed into {self.target.table!r} "
                    f"(committed through {committed}); the stage's Spark checkpoint is behind the table: restore the "
                    "pipeline from an epoch (restore_from='latest')"
                )
            cur.execute(sql.SQL("DELETE FROM {} WHERE {} = %s").format(self._ident(self._pending_name),
                                                                       sql.Identifier(_BATCH)), (batch_id,))
            # rendered here: executors get plain SQL
            return insert.as_string(cur), delete.as_string(cur), self._fence_sql("SHARE").as_string(cur)

        insert_sql, delete_sql, fence_sql = self._run(
            clear, what=f"clearing an earlier attempt of micro-batch {batch_id}")
        writer = _PartitionWriter(self.dsn, self.stage, batch_id, names, not_null, insert_sql, delete_sql,
                                  fence=(fence_sql, self.token) if self.generation else None)
        df.foreachPartition(writer)

    # ------------------------------------------------------------------ commit, rollback, trim

    def _cols(self, prefix: str | None = None) -> sql.Composable:
        assert self._columns is not None
        return sql.SQL(", ").join(sql.Identifier(prefix, c.name) if prefix else sql.Identifier(c.name)
                                  for c in self._columns)

    def _apply(self, cur: PgCursor, after: int, through: int) -> tuple[int, tuple[int, ...]]:
        """Apply the pending batches in ``(after, through]`` to the table; returns rows written and the
        batches applied."""
        pending, target = self._ident(self._pending_name), self._target
        batch = sql.Identifier(_BATCH)
        cur.execute(sql.SQL("SELECT DISTINCT {b} AS b FROM {p} WHERE {b} > %s AND {b} <= %s ORDER BY 1").format(
            b=batch, p=pending), (after, through))
        batches = tuple(int(r["b"]) for r in cur.fetchall())
        if self.mode == "append":
            cur.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {p} WHERE {b} > %s AND {b} <= %s "
                                "ORDER BY {b}, {part}, {seq}").format(
                t=target, c=self._cols(), p=pending, b=batch, part=sql.Identifier(_PART), seq=sql.Identifier(_SEQ)),
                (after, through))
            return int(cur.rowcount), batches
        assert self._columns is not None
        keys = [sql.Identifier(k) for k in self.key]
        key_list = sql.SQL(", ").join(keys)
        join_on = sql.SQL(" AND ").join(sql.SQL("t.{k} = k.{k}").format(k=k) for k in keys)
        pre_cols = sql.SQL(", ").join(
            sql.SQL("k.{}").format(sql.Identifier(c.name)) if c.name in self.key else
            sql.SQL("t.{}").format(sql.Identifier(c.name)) for c in self._columns)
        update = self._on_conflict()
        written = 0
        for b in batches:
            cur.execute(sql.SQL(
                "INSERT INTO {u} ({b}, {e}, {c}) SELECT %s, t.ctid IS NOT NULL, {pre} FROM "
                "(SELECT DISTINCT {keys} FROM {p} WHERE {b} = %s) k LEFT JOIN {t} t ON {on}").format(
                u=self._ident(self._undo_name), b=batch, e=sql.Identifier(_EXISTED), c=self._cols(), pre=pre_cols,
                keys=key_list, p=pending, t=target, on=join_on), (b, b))
            cur.execute(sql.SQL(
                "INSERT INTO {t} ({c}) SELECT {c} FROM (SELECT DISTINCT ON ({keys}) * FROM {p} WHERE {b} = %s "
                "ORDER BY {keys}, {part} DESC, {seq} DESC) last ON CONFLICT ({keys}) {update}").format(
                t=target, c=self._cols(), keys=key_list, p=pending, b=batch, part=sql.Identifier(_PART),
                seq=sql.Identifier(_SEQ), update=update), (b,))
            written += int(cur.rowcount)
        cur.execute(sql.SQL("DELETE FROM {p} WHERE {b} > %s AND {b} <= %s").format(p=pending, b=batch),
                    (after, through))  # an upsert's rollback needs the pre-images only
        return written, batches

    def _on_conflict(self) -> sql.Composable:
        """``DO UPDATE SET`` every non-key column to the incoming row's (``DO NOTHING`` for a key-only table)."""
        assert self._columns is not None
        non_key = [c.name for c in self._columns if c.name not in self.key]
        if not non_key:
            return sql.SQL("DO NOTHING")
        return sql.SQL("DO UPDATE SET ") + sql.SQL(", ").join(
            sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(n)) for n in non_key)

    def _set_committed(self, cur: PgCursor, batch_id: int) -> None:
        cur.execute(sql.SQL("UPDATE {} SET committed_batch = %s, updated_at = now() "
                            "WHERE pipeline_id = %s AND sink = %s").format(self._ident(_PROGRESS)),
                    (batch_id, self.pipeline_id, self.stage))

    def pending_output(self, batch_from: int, batch_to: int) -> dict[str, Any]:  # noqa: ARG002 - the gate's range
        """Where pre-committed batches wait, for a commit gate (:func:`airflow_arroyo.core.gates.pending_output` selects
        the gate's range): the pending table, in the target table's schema, and the target's columns. No rows are
        read here."""
        if self._columns is None:
            self._run(self._describe, what="reading the table's columns")
        assert self._columns is not None
        return {"kind": "postgres", "schema": self._schema or "public", "pending_table": self._pending_name,
                "target": self.target.table, "columns": [c.name for c in self._columns], "batch_column": _BATCH}

    def commit_through(self, batch_id: int) -> SinkCommit:
        """Make every pending batch ``<= batch_id`` visible in one transaction; says what it wrote."""

        def tx(cur: PgCursor) -> tuple[int, tuple[int, ...]]:
            self._describe(cur)
            committed = self._progress(cur, lock=True)
            if committed is None:
                raise ConfigurationError(f"sink {self.stage!r}: no progress row in {self.target.table!r}'s schema; "
                                         "the sink was never claimed")
            self._fence(cur, take=False, what=f"the commit through micro-batch {batch_id}")
            if batch_id <= committed:
                return 0, ()
            done = self._apply(cur, committed, batch_id)
            self._set_committed(cur, batch_id)
            return done

        written, batches = self._run(tx, what=f"committing micro-batches through {batch_id}")
        if written:
            log.info("pipeline=%s sink=%s: committed batches <= %s (%d rows) into %s", self.pipeline_id, self.stage,
                     batch_id, written, self.target.table)
        return SinkCommit(files=0, bytes=0, rows=int(written), batches=tuple(batches))

    def rollback_to(self, batch_id: int) -> None:
        """Restore: the table holds exactly the batches ``<= batch_id`` (``-1``: none of this sink's rows)."""

        def tx(cur: PgCursor) -> tuple[int, int]:
            self._describe(cur)
            committed = self._progress(cur, lock=True)
            if committed is None:
                return 0, 0
            self._fence(cur, take=True, what=f"the rollback to micro-batch {batch_id}")
            applied = undone = 0
            if committed < batch_id:
                applied = self._apply(cur, committed, batch_id)[0]
            elif committed > batch_id:
                undone = self._undo(cur, batch_id, committed)
            cur.execute(sql.SQL("DELETE FROM {p} WHERE {b} > %s").format(
                p=self._ident(self._pending_name), b=sql.Identifier(_BATCH)), (batch_id,))
            self._set_committed(cur, batch_id)
            return applied, undone

        applied, undone = self._run(tx, what=f"rolling back to micro-batch {batch_id}")
        log.info("pipeline=%s sink=%s: rolled %s back to batch %s (%d rows committed, %d rows of later batches "
                 "undone)", self.pipeline_id, self.stage, self.target.table, batch_id, applied, undone)

    def _undo(self, cur: PgCursor, to: int, committed: int) -> int:
        target, batch = self._target, sql.Identifier(_BATCH)
        assert self._columns is not None
        if self.mode == "append":
            cols = [sql.Identifier(c.name) for c in self._columns]
            same = sql.SQL(" AND ").join(sql.SQL("t.{c} IS NOT DISTINCT FROM d.{c}").format(c=c) for c in cols)
            cur.execute(sql.SQL(
                "DELETE FROM {t} WHERE ctid IN (SELECT ctid FROM (SELECT t.ctid, d.n, row_number() OVER "
                "(PARTITION BY {tcols} ORDER BY t.ctid) AS rn FROM {t} t JOIN (SELECT {c}, count(*) AS n FROM {p} "
                "WHERE {b} > %s AND {b} <= %s GROUP BY {c}) d ON {same}) x WHERE rn <= n)").format(
                t=target, tcols=sql.SQL(", ").join(sql.SQL("t.{}").format(c) for c in cols), c=self._cols(),
                p=self._ident(self._pending_name), b=batch, same=same), (to, committed))
            return int(cur.rowcount)
        keys = [sql.Identifier(k) for k in self.key]
        key_list = sql.SQL(", ").join(keys)
        firsts = sql.SQL("(SELECT DISTINCT ON ({keys}) * FROM {u} WHERE {b} > %s ORDER BY {keys}, {b})").format(
            keys=key_list, u=self._ident(self._undo_name), b=batch)
        on = sql.SQL(" AND ").join(sql.SQL("t.{k} = f.{k}").format(k=k) for k in keys)
        cur.execute(sql.SQL("DELETE FROM {t} t USING {f} f WHERE {on} AND NOT f.{e}").format(
            t=target, f=firsts, on=on, e=sql.Identifier(_EXISTED)), (to,))
        deleted = int(cur.rowcount)
        update = self._on_conflict()
        cur.execute(sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {f} f WHERE f.{e} ON CONFLICT ({keys}) {update}")
                    .format(t=target, c=self._cols(), f=firsts, e=sql.Identifier(_EXISTED), keys=key_list,
                            update=update), (to,))
        restored = int(cur.rowcount)
        cur.execute(sql.SQL("DELETE FROM {u} WHERE {b} > %s").format(u=self._ident(self._undo_name), b=batch), (to,))
        return deleted + restored

    def public_after(self, batch_id: int) -> int | None:  # noqa: ARG002 - the protocol's signature
        """None: a rollback takes back whatever was committed after ``batch_id`` (readers see it go)."""
        return None

    def close(self) -> None:
        """Nothing kept open between calls: each one connects (a connection would not outlive an outage)."""

    def trim_through(self, batch_id: int) -> None:
        """Forget how to undo batches ``<= batch_id`` (no restore can go behind the epoch that cut there); a
        ``keep_journal`` sink (a shadow run's) forgets nothing."""
        if self.target.keep_journal:
            return

        def tx(cur: PgCursor) -> None:
            self._describe(cur)
            committed = self._progress(cur, lock=True)
            if committed is None:
                return
            # fenced like every write: a superseded run's floor is in its own batch ids, which a newer run re-uses
            self._fence(cur, take=False, what=f"the trim of the journal through micro-batch {batch_id}")
            upto = min(batch_id, committed)
            for name in (self._pending_name, self._undo_name):
                cur.execute(sql.SQL("DELETE FROM {} WHERE {} <= %s").format(self._ident(name), sql.Identifier(_BATCH)),
                            (upto,))
            cur.execute(sql.SQL("UPDATE {} SET trimmed_batch = GREATEST(trimmed_batch, %s) "
                                "WHERE pipeline_id = %s AND sink = %s").format(self._ident(_PROGRESS)),
                        (upto, self.pipeline_id, self.stage))

        self._run(tx, what=f"trimming the journal through micro-batch {batch_id}")


@dataclass(frozen=True)
class BatchWindow:
    """One window of a shadow compare in sink batches: the live sink's batches in (``live_after``,
    ``live_through``] and the shadow sink's in (``shadow_after``, ``shadow_through``] (empty when equal)."""

    live_after: int
    live_through: int
    shadow_after: int
    shadow_through: int


Row = dict[str, Any]


def shadow_window_rows(live: TransactionalPostgresSink, shadow: TransactionalPostgresSink, live_base: int,
                       windows: Sequence[BatchWindow]) -> list[tuple[list[Row], list[Row]] | None]:
    """Per window, the rows the live sink and the shadow sink committed (None: a side has not committed the
    window's batches yet), read from their journals in one READ ONLY REPEATABLE READ transaction (one snapshot,
    while both keep committing). Both tables live in one database (a shadow table is the live one's sibling).
    ``live_base``: the live sink's cut at the fork point, where the shadow's batches start.

    * ``append``: the journal rows of each side's batches: exactly what each side inserted.
    * ``upsert``: per key either side wrote in the window, the row each side's table held at its window's last
      batch (a key's pre-image at the first later batch that touched it, else the table's row now). The shadow
      table starts empty at the fork point while the shadow's state does not, so a key the shadow has not written
      since the fork counts as the live table's row at ``live_base`` (the live sink's cut at the fork point): what
      the shadow's table would hold had it started as a copy.

    Raises :class:`ConfigurationError` when a side's journal no longer covers the windows (trimmed by retention, or
    trimmed before the sink recorded how far), naming the sink."""
    if shadow.mode != live.mode or list(shadow.key) != list(live.key):
        raise ConfigurationError(f"sink {live.stage!r}: the live and the shadow sink differ in mode or key; a "
                                 "shadow compares like with like")

    def progress(cur: PgCursor, sink: TransactionalPostgresSink) -> dict[str, Any] | None:
        sink._describe(cur)
        cur.execute("SELECT to_regclass(%s) IS NOT NULL AS present", (sink._ident(_PROGRESS).as_string(cur),))
        row = cur.fetchone()
        if not row or not row["present"]:
            return None
        cur.execute(sql.SQL("SELECT * FROM {} WHERE pipeline_id = %s AND sink = %s").format(sink._ident(_PROGRESS)),
                    (sink.pipeline_id, sink.stage))
        found = cur.fetchone()
        return None if found is None else dict(found)

    def covered(sink: TransactionalPostgresSink, row: dict[str, Any] | None, after: int) -> bool:
        if row is None:
            return False
        trimmed = row.get("trimmed_batch")
        if trimmed is None or int(trimmed) > after:
            how = f"through batch {trimmed}" if trimmed is not None else "before it recorded how far"
            raise ConfigurationError(
                f"sink {sink.stage!r} of pipeline {sink.pipeline_id!r}: its journal in {sink.target.table!r}'s schema "
                f"was trimmed {how}, so the rows of batches after {after} are no longer all there; compare a shadow "
                "forked after the sink's next trim (its fork point's pin keeps the live journal from then on)")
        return True

    def tx(cur: PgCursor) -> list[tuple[list[Row], list[Row]] | None]:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        live_row, shadow_row = progress(cur, live), progress(cur, shadow)
        if not covered(live, live_row, live_base):
            raise ConfigurationError(f"sink {live.stage!r} of pipeline {live.pipeline_id!r} never wrote "
                                     f"{live.target.table!r}: there is nothing to compare the shadow with")
        has_shadow = covered(shadow, shadow_row, live_base)
        live_committed = int(live_row["committed_batch"]) if live_row else -1
        shadow_committed = int(shadow_row["committed_batch"]) if shadow_row else -1
        out: list[tuple[list[Row], list[Row]] | None] = []
        for w in windows:
            if w.live_through > live_committed or (w.shadow_through > max(shadow_committed, w.shadow_after)):
                out.append(None)  # completed, not committed yet (a commit follows its epoch; a gate may hold it)
                continue
            if live.mode == "append":
                lrows = _journal(cur, live, w.live_after, w.live_through)
                srows = _journal(cur, shadow, w.shadow_after, w.shadow_through) if has_shadow else []
            else:
                lrows, srows = _upserted(cur, live, shadow if has_shadow else None, live_base, w)
            out.append((lrows, srows))
        return out

    result: list[tuple[list[Row], list[Row]] | None] = live._run(tx, what="reading the live and shadow journals")
    return result


def _journal(cur: PgCursor, sink: TransactionalPostgresSink, after: int, through: int) -> list[Row]:
    if through <= after:
        return []
    cur.execute(sql.SQL("SELECT {c} FROM {p} WHERE {b} > %s AND {b} <= %s").format(
        c=sink._cols(), p=sink._ident(sink._pending_name), b=sql.Identifier(_BATCH)), (after, through))
    return [dict(r) for r in cur.fetchall()]


def _touched(sink: TransactionalPostgresSink, after: int, through: int) -> tuple[sql.Composable, tuple[int, ...]]:
    return (sql.SQL("SELECT {k} FROM {u} WHERE {b} > %s AND {b} <= %s").format(
        k=sql.SQL(", ").join(map(sql.Identifier, sink.key)), u=sink._ident(sink._undo_name), b=sql.Identifier(_BATCH)),
        (after, through))


def _state_at(cur: PgCursor, sink: TransactionalPostgresSink, cut: int, keys: sql.Composable,
              params: tuple[int, ...]) -> dict[tuple[Any, ...], Row]:
    """The rows ``sink``'s table held right after batch ``cut`` for the keys ``keys`` selects: a key's pre-image at
    the first batch after ``cut`` that touched it (none when it did not exist), else the table's row now."""
    key = [sql.Identifier(k) for k in sink.key]

    def on(a: str, b: str) -> sql.Composable:
        return sql.SQL(" AND ").join(sql.SQL("{a}.{k} = {b}.{k}").format(a=sql.Identifier(a), b=sql.Identifier(b), k=k)
                                     for k in key)

    undo, batch = sink._ident(sink._undo_name), sql.Identifier(_BATCH)
    cur.execute(sql.SQL(
        "SELECT DISTINCT ON ({uk}) {uc}, u.{e} AS {e} FROM {u} u JOIN ({keys}) k ON {on} WHERE u.{b} > %s "
        "ORDER BY {uk}, u.{b}").format(
        uk=sql.SQL(", ").join(sql.SQL("u.{}").format(k) for k in key), uc=sink._cols("u"), e=sql.Identifier(_EXISTED),
        u=undo, keys=keys, on=on("u", "k"), b=batch), (*params, cut))
    out: dict[tuple[Any, ...], Row] = {}
    for r in cur.fetchall():
        row = dict(r)
        if row.pop(_EXISTED):
            out[tuple(row[k] for k in sink.key)] = row
    cur.execute(sql.SQL(
        "SELECT {tc} FROM {t} t JOIN (SELECT DISTINCT * FROM ({keys}) x) k ON {on} "
        "WHERE NOT EXISTS (SELECT 1 FROM {u} u WHERE {uon} AND u.{b} > %s)").format(
        tc=sink._cols("t"), t=sink._target, keys=keys, on=on("t", "k"), u=undo, uon=on("u", "t"), b=batch),
        (*params, cut))
    for r in cur.fetchall():
        row = dict(r)
        out[tuple(row[k] for k in sink.key)] = row
    return out


def _upserted(cur: PgCursor, live: TransactionalPostgresSink, shadow: TransactionalPostgresSink | None,
              live_base: int, w: BatchWindow) -> tuple[list[Row], list[Row]]:
    """An upsert window: both sides' rows of the keys either side wrote in it (see :func:`shadow_window_rows`)."""
    keys, params = _touched(live, w.live_after, w.live_through)
    if shadow is not None:
        other, more = _touched(shadow, w.shadow_after, w.shadow_through)
        keys, params = sql.SQL("{} UNION {}").format(keys, other), (*params, *more)
    live_now = _state_at(cur, live, w.live_through, keys, params)
    at_fork = _state_at(cur, live, live_base, keys, params)
    shadow_now = _state_at(cur, shadow, w.shadow_through, keys, params) if shadow is not None else {}
    # keys the shadow never wrote since the fork: its table would hold the live row at the fork point
    written: set[tuple[Any, ...]] = set()
    if shadow is not None:
        ever, ever_params = _touched(shadow, -1, w.shadow_through)
        cur.execute(sql.SQL("SELECT DISTINCT k.* FROM ({keys}) k JOIN ({ever}) e ON {on}").format(
            keys=keys, ever=ever, on=sql.SQL(" AND ").join(sql.SQL("k.{k} = e.{k}").format(k=sql.Identifier(k))
                                                             for k in live.key)), (*params, *ever_params))
        written = {tuple(r[k] for k in live.key) for r in cur.fetchall()}
    shadow_rows = [row for k, row in ((k, shadow_now.get(k) if k in written else at_fork.get(k))
                                      for k in live_now.keys() | at_fork.keys() | shadow_now.keys()) if row is not None]
    return list(live_now.values()), shadow_rows


class _PartitionWriter:
    """Runs on the executors: stages one partition of a micro-batch in one transaction of its own."""

    def __init__(self, dsn: str, stage: str, batch_id: int, names: list[str], not_null: list[int],
                 insert: str, delete: str, *, fence: tuple[str, FencingToken | None] | None = None) -> None:
        self.dsn, self.stage, self.batch_id = dsn, stage, batch_id
        self.names, self.not_null, self.insert, self.delete = names, not_null, insert, delete
        self.fence = fence  # (SELECT generation ... FOR SHARE, the run's token): refused once a newer run claimed

    def __call__(self, rows: Iterable[Any]) -> None:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        part = ctx.partitionId() if ctx is not None else 0
        values = [(self.batch_id, part, i, *_adapt(row)) for i, row in enumerate(rows)]
        for v in values:
            for i in self.not_null:
                if v[3 + i] is None:
                    raise ConfigurationError(f"sink {self.stage!r}: column {self.names[i]!r} is NOT NULL in the table "
                                             f"but micro-batch {self.batch_id} has a null in it")

        def attempt() -> None:
            conn = psycopg2.connect(self.dsn, application_name=f"arroyo-sink-{self.stage}")
            try:
                with conn, conn.cursor() as cur:
                    if self.fence is not None and self.fence[1] is not None:
                        token = self.fence[1]
                        cur.execute(self.fence[0], (token.pipeline_id, self.stage))
                        row = cur.fetchone()
                        if row is not None and int(row[0]) > token.generation:
                            raise FencedError(token.pipeline_id, token.run_id, token.generation,
                                              by_generation=int(row[0]),
                                              what=f"the pre-commit of micro-batch {self.batch_id} of sink "
                                                   f"{self.stage!r}")
                    cur.execute(self.delete, (self.batch_id, part))
                    if values:
                        psycopg2.extras.execute_values(cur, self.insert, values, page_size=1000)
            finally:
                conn.close()

        retrying()(attempt)


def _adapt(row: Any) -> Iterator[Any]:
    for v in row:
        if isinstance(v, bytearray):
            yield bytes(v)
        elif isinstance(v, dict):
            yield psycopg2.extras.Json(v)
        else:
            yield v
