"""Snapshot objects: the content-addressed files the epochs' snapshots reference (``arroyo_objects``,
``arroyo_epoch_objects``), and what a scrub found when it re-hashed them (migration 0005)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import psycopg2.extras

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConcurrencyConflict, ConfigurationError, UnknownEpochError
from airflow_arroyo.store._db import Concern, PgCursor
from airflow_arroyo.store.pipelines import check_token, read_pipeline
from airflow_arroyo.store.records import FencingToken, ObjectRecord, SnapshotEntry

__all__ = ["Objects"]


class Objects(Concern):
    """Snapshot objects and their references per epoch and stage; scrub results."""

    def known_objects(self, pipeline_id: str, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are already stored for the pipeline (incremental snapshots skip them). An object
        a scrub found missing or corrupt is not: the next snapshot that has the file copies it again."""
        key_list = list(keys)

        def tx(cur: PgCursor) -> set[str]:
            cur.execute("SELECT object_key FROM arroyo_objects WHERE pipeline_id = %s AND object_key = ANY(%s)"
                        " AND verify_state IS DISTINCT FROM 'missing' AND verify_state IS DISTINCT FROM 'corrupt'",
                        (pipeline_id, key_list))
            return {r["object_key"] for r in cur.fetchall()}

        return self._db.tx(tx) if key_list else set()

    def record_snapshot(self, pipeline_id: str, epoch: int, stage: str, entries: Sequence[SnapshotEntry], *,
                        token: FencingToken | None = None) -> None:
        """Record the files of a stage's snapshot for an epoch (objects are inserted once).

        Refused with :class:`ConcurrencyConflict` once the epoch is ``pruning`` or ``pruned`` (a late
        acknowledgement after expiry and cleanup): recorded then, its objects would never be deleted.
        The caller should delete the objects it wrote new for this snapshot.
        """

        def tx(cur: PgCursor) -> None:
            check_token(cur, token, f"the snapshot of stage {stage!r} for epoch {epoch}")
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch, "to record a snapshot for")
            if row["state"] in (EpochState.PRUNING.value, EpochState.PRUNED.value):
                raise ConcurrencyConflict(
                    f"epoch {epoch} of {pipeline_id!r} is {row['state']}: the snapshot of stage {stage!r} came "
                    "too late to be recorded"
                )
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO arroyo_objects (pipeline_id, object_key, bytes, first_epoch) VALUES %s"
                " ON CONFLICT (pipeline_id, object_key) DO UPDATE SET verified_at = NULL, verify_state = NULL,"
                "   verify_detail = NULL WHERE arroyo_objects.verify_state IN ('missing', 'corrupt')",
                sorted({(pipeline_id, e.object_key, e.bytes, epoch) for e in entries}),
            )
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO arroyo_epoch_objects (pipeline_id, epoch, stage, rel_path, object_key) VALUES %s"
                " ON CONFLICT DO NOTHING",
                [(pipeline_id, epoch, stage, e.rel_path, e.object_key) for e in entries],
            )

        if entries:
            self._db.tx(tx)

    def snapshot_entries(self, pipeline_id: str, epoch: int, stage: str) -> list[SnapshotEntry]:
        """The files of stage ``stage``'s snapshot for ``epoch``, by path."""

        def tx(cur: PgCursor) -> list[SnapshotEntry]:
            cur.execute(
                "SELECT eo.rel_path, eo.object_key, o.bytes FROM arroyo_epoch_objects eo"
                " JOIN arroyo_objects o USING (pipeline_id, object_key)"
                " WHERE eo.pipeline_id = %s AND eo.epoch = %s AND eo.stage = %s ORDER BY eo.rel_path",
                (pipeline_id, epoch, stage),
            )
            return [SnapshotEntry(r["rel_path"], r["object_key"], int(r["bytes"])) for r in cur.fetchall()]

        return self._db.tx(tx)

    # ------------------------------------------------------------------ scrubbing (migration 0005)

    def objects_to_verify(self, pipeline_id: str, *, epoch: int | None = None) -> list[ObjectRecord]:
        """The objects the retained epochs (or only ``epoch``) reference, least recently verified first
        (never verified first, then oldest check), each with the retained epochs that reference it."""

        def tx(cur: PgCursor) -> list[ObjectRecord]:
            read_pipeline(cur, pipeline_id)
            if epoch is not None:
                cur.execute("SELECT 1 FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s", (pipeline_id, epoch))
                if cur.fetchone() is None:
                    raise ConfigurationError(f"pipeline {pipeline_id!r} has no epoch {epoch}")
            cur.execute(
                "SELECT o.object_key, o.bytes, o.verified_at, o.verify_state, o.verify_detail,"
                " array_agg(DISTINCT eo.epoch ORDER BY eo.epoch) AS epochs"
                " FROM arroyo_objects o JOIN arroyo_epoch_objects eo USING (pipeline_id, object_key)"
                " JOIN arroyo_epochs e USING (pipeline_id, epoch)"
                " WHERE o.pipeline_id = %s AND e.state NOT IN ('pruning', 'pruned')"
                " AND (%s::bigint IS NULL OR o.object_key IN (SELECT object_key FROM arroyo_epoch_objects"
                "   WHERE pipeline_id = %s AND epoch = %s))"
                " GROUP BY o.object_key, o.bytes, o.verified_at, o.verify_state, o.verify_detail"
                " ORDER BY o.verified_at NULLS FIRST, o.object_key",
                (pipeline_id, epoch, pipeline_id, epoch),
            )
            return [ObjectRecord(r["object_key"], int(r["bytes"]), r["verified_at"], r["verify_state"],
                                 r["verify_detail"], tuple(int(e) for e in r["epochs"])) for r in cur.fetchall()]

        return self._db.tx(tx)

    def record_verification(self, pipeline_id: str, results: Sequence[tuple[str, str, str | None]]) -> None:
        """Record scrub results ``(object_key, 'ok' | 'missing' | 'corrupt', detail)`` at database time."""

        def tx(cur: PgCursor) -> None:
            psycopg2.extras.execute_values(
                cur,
                "UPDATE arroyo_objects o SET verified_at = clock_timestamp(), verify_state = r.state,"
                " verify_detail = r.detail FROM (VALUES %s) AS r(pipeline_id, object_key, state, detail)"
                " WHERE o.pipeline_id = r.pipeline_id AND o.object_key = r.object_key",
                [(pipeline_id, k, st, d) for k, st, d in results],
            )

        if results:
            self._db.tx(tx)

    def damaged_objects(self, pipeline_id: str) -> list[ObjectRecord]:
        """Objects the last scrub found missing or corrupt that retained epochs still reference."""
        return [o for o in self.objects_to_verify(pipeline_id) if o.verify_state not in (None, "ok")]

