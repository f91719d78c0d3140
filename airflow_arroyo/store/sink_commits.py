"""What each sink made visible per epoch (``arroyo_sink_commits``, migration 0003): the source of the Asset
events of sink commits and of a sink's rollback on restore."""

from __future__ import annotations

from airflow_arroyo.store._db import Concern, PgCursor, one
from airflow_arroyo.store.pipelines import check_token
from airflow_arroyo.store.records import FencingToken, SinkCommitRecord, from_row

__all__ = ["SinkCommits"]

_SINK_COMMIT_COLS = ("seq, pipeline_id, epoch, sink, uri, run_id, batch_id, files, rows_committed, bytes_committed,"
                     " committed_at, table_version")


class SinkCommits(Concern):
    """The sinks' commit records, one per (pipeline, sink, epoch), in commit order (``seq``)."""

    def record_sink_commit(self, pipeline_id: str, epoch: int, sink: str, *, uri: str, batch_id: int, files: int,
                           rows: int | None, bytes_committed: int, run_id: str | None = None,
                           token: FencingToken | None = None, table_version: int | None = None) -> SinkCommitRecord:
        """Record what a sink made visible for ``epoch`` (idempotent: a repeat returns the first record);
        ``table_version``: the version a table sink's commit made (a Delta table's)."""

        def tx(cur: PgCursor) -> SinkCommitRecord:
            check_token(cur, token, f"the commit record of sink {sink!r} for epoch {epoch}")
            cur.execute(
                "INSERT INTO arroyo_sink_commits (pipeline_id, epoch, sink, uri, run_id, batch_id, files,"
                " rows_committed, bytes_committed, table_version) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (pipeline_id, sink, epoch) DO NOTHING",
                (pipeline_id, epoch, sink, uri, run_id, batch_id, files, rows, bytes_committed, table_version),
            )
            cur.execute(f"SELECT {_SINK_COMMIT_COLS} FROM arroyo_sink_commits"  # noqa: S608
                        " WHERE pipeline_id = %s AND sink = %s AND epoch = %s", (pipeline_id, sink, epoch))
            return from_row(SinkCommitRecord, one(cur))

        return self._db.tx(tx)

    def sink_commits(self, pipeline_id: str, *, after_seq: int = 0, sink: str | None = None,
                     limit: int = 100) -> list[SinkCommitRecord]:
        """Commits of the pipeline's file sinks after ``after_seq``, oldest first."""

        def tx(cur: PgCursor) -> list[SinkCommitRecord]:
            cur.execute(
                f"SELECT {_SINK_COMMIT_COLS} FROM arroyo_sink_commits WHERE pipeline_id = %(p)s"  # noqa: S608
                " AND seq > %(after)s AND (%(sink)s::text IS NULL OR sink = %(sink)s)"
                " ORDER BY seq LIMIT %(limit)s",
                {"p": pipeline_id, "after": after_seq, "sink": sink, "limit": limit},
            )
            return [from_row(SinkCommitRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def latest_sink_commit(self, pipeline_id: str, sink: str) -> SinkCommitRecord | None:
        """The newest commit record of the pipeline's sink ``sink``, if any."""

        def tx(cur: PgCursor) -> SinkCommitRecord | None:
            cur.execute(f"SELECT {_SINK_COMMIT_COLS} FROM arroyo_sink_commits"  # noqa: S608
                        " WHERE pipeline_id = %s AND sink = %s ORDER BY seq DESC LIMIT 1", (pipeline_id, sink))
            row = cur.fetchone()
            return from_row(SinkCommitRecord, row) if row is not None else None

        return self._db.tx(tx)

