"""Pins and forks: an epoch kept by retention under a label, and a pipeline forked from a completed epoch of
another (whose fork point stays pinned while the fork still needs it)."""

from __future__ import annotations

import json

from airflow_arroyo.core.epochs import EpochState, PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import (
    ConcurrencyConflict,
    ConfigurationError,
    StateConflictError,
    UnknownEpochError,
)
from airflow_arroyo.store._db import Concern, Database, PgCursor, one
from airflow_arroyo.store._prepared import Prepared, execute_prepared
from airflow_arroyo.store.epochs import Epochs
from airflow_arroyo.store.pipelines import lock_pipeline, read_pipeline
from airflow_arroyo.store.records import EpochRecord, PipelineRecord, epoch_columns, from_row

__all__ = ["PIN_LABEL_MAX", "Pins", "forks_waiting"]

_EPOCH_COLS = epoch_columns()
#: The longest pin label (migration 0008 checks the same bound).
PIN_LABEL_MAX = 200
# A fork's and its source's row locks, in id order.
_LOCK_SQL = "SELECT * FROM arroyo_pipelines WHERE pipeline_id = ANY($1) ORDER BY pipeline_id FOR UPDATE"
_LOCK_PIPELINES = Prepared("arroyo_lock_pipelines", ("text[]",), _LOCK_SQL)


def forks_waiting(cur: PgCursor, pipeline_id: str, epoch: int | None = None) -> list[str]:
    """Forks of ``pipeline_id`` (of its ``epoch``, or of any) that have not completed an epoch of their own:
    they still need their fork point. A fork's own epoch that completed once (outcome ``completed`` or
    ``superseded``) holds its own copy of every object, so the fork no longer reads the source's."""
    cur.execute(
        "SELECT f.pipeline_id FROM arroyo_pipelines f WHERE f.forked_from_pipeline = %s"
        " AND (%s::bigint IS NULL OR f.forked_from_epoch = %s::bigint)"
        " AND NOT EXISTS (SELECT 1 FROM arroyo_epochs e WHERE e.pipeline_id = f.pipeline_id"
        "   AND e.outcome IN ('completed', 'superseded'))"
        " ORDER BY f.pipeline_id",
        (pipeline_id, epoch, epoch),
    )
    return [r["pipeline_id"] for r in cur.fetchall()]


class Pins(Concern):
    """Pinned epochs (``arroyo_epochs.pin_label``) and forks (``arroyo_pipelines.forked_from_*``)."""

    def __init__(self, db: Database, epochs: Epochs) -> None:
        super().__init__(db)
        self._epochs = epochs

    @staticmethod
    def check_pin_label(label: object) -> str:
        """The pin label as stored (stripped); :class:`ConfigurationError` unless it is 1 to 200 characters."""
        text = label.strip() if isinstance(label, str) else ""
        if not text or len(text) > PIN_LABEL_MAX:
            raise ConfigurationError(
                f"pin label must be 1 to {PIN_LABEL_MAX} characters of text, got {label!r}: say why the epoch "
                "is kept, e.g. --label 'before the 2.0 upgrade'"
            )
        return text

    def pin_epoch(self, pipeline_id: str, epoch: int, label: str, *, replace: bool = False) -> EpochRecord:
        """Pin a completed epoch with ``label``: retention keeps it, its snapshot objects and the channel
        ranges a restore of it reads, until :meth:`unpin_epoch`. Pinning a pinned epoch with its own label
        again changes nothing; with another label it is refused unless ``replace`` (``pinned_at`` stays the
        first pin's), since the label is why someone kept it.

        Raises :class:`ConfigurationError` for an empty or over-long label, :class:`StateConflictError` for an
        epoch that is not completed (nothing restorable to keep) or pinned with another label (naming it)
        without ``replace``, :class:`UnknownEpochError` for an unknown one.
        """
        text = self.check_pin_label(label)

        def tx(cur: PgCursor) -> EpochRecord:
            lock_pipeline(cur, pipeline_id)  # retention's begin_prune holds the same lock
            # the row lock keeps the state we check until the pin is written
            cur.execute("SELECT state, pin_label FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (pipeline_id, epoch))
            found = cur.fetchone()
            if found is None:
                raise UnknownEpochError(pipeline_id, epoch, "to pin")
            if found["pin_label"] is not None and found["pin_label"] != text and not replace:
                raise StateConflictError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is already pinned with label {found['pin_label']!r}; "
                    "pass --replace to replace that label (replace=True), or keep it"
                )
            if found["state"] != EpochState.COMPLETED.value:
                raise StateConflictError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is {found['state']}, not completed: only a completed "
                    "epoch can be restored, so only one can be pinned; pick a completed epoch (airflow-arroyo "
                    f"epochs {pipeline_id})" + (" or wait for this one to end" if found["state"] == "triggered" else "")
                )
            cur.execute(
                f"UPDATE arroyo_epochs SET pin_label = %s, pinned_at = COALESCE(pinned_at, clock_timestamp())"  # noqa: S608
                f" WHERE pipeline_id = %s AND epoch = %s RETURNING {_EPOCH_COLS}",
                (text, pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:  # cannot happen under the row lock; say what it would mean
                raise UnknownEpochError(pipeline_id, epoch, "to pin")
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    def pin_final_epoch(self, pipeline_id: str, run_id: str | None, label: str) -> EpochRecord:
        """Pin the final epoch a graceful stop of run ``run_id`` took (the second half of "stop and pin").

        Raises :class:`StateConflictError` when that run completed no final epoch (an immediate stop, a final
        epoch that failed or timed out), naming the latest completed epoch, which can be pinned instead."""

        def tx(cur: PgCursor) -> int | None:
            read_pipeline(cur, pipeline_id)
            cur.execute("SELECT epoch FROM arroyo_epochs WHERE pipeline_id = %s AND run_id IS NOT DISTINCT FROM %s"
                        " AND is_final AND state = %s ORDER BY epoch DESC LIMIT 1",
                        (pipeline_id, run_id, EpochState.COMPLETED.value))
            row = cur.fetchone()
            return int(row["epoch"]) if row is not None else None

        final = self._db.tx(tx)
        if final is None:
            latest = self._epochs.latest_completed_epoch(pipeline_id)
            instead = (f"pin the latest completed epoch instead: airflow-arroyo pin {pipeline_id} {latest.epoch} "
                       "--label ..." if latest is not None else "no epoch of it is completed")
            raise StateConflictError(
                f"run {run_id} of pipeline {pipeline_id!r} completed no final epoch (an immediate stop, or its final "
                f"epoch failed or timed out), so nothing was pinned; {instead}"
            )
        return self.pin_epoch(pipeline_id, final, label)

    def unpin_epoch(self, pipeline_id: str, epoch: int, *, force: bool = False) -> EpochRecord:
        """Unpin ``epoch`` (idempotent: an epoch that is not pinned is returned as it is); retention may
        prune it again from its next run.

        Refused (:class:`StateConflictError`, naming them) while a fork of this epoch has not completed an
        epoch of its own (:meth:`waiting_forks`): its first restore reads this epoch's objects and channel
        ranges. ``force`` unpins anyway; those forks can then no longer start once retention prunes it."""

        def tx(cur: PgCursor) -> EpochRecord:
            lock_pipeline(cur, pipeline_id)
            waiting = forks_waiting(cur, pipeline_id, epoch)
            if waiting and not force:
                raise StateConflictError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is the fork point of {', '.join(waiting)}, which "
                    "has not completed an epoch of its own yet: its first run restores from this epoch. Run the fork "
                    "until it completes an epoch, or unpin with --force if the fork is abandoned"
                )
            cur.execute(
                f"UPDATE arroyo_epochs SET pin_label = NULL, pinned_at = NULL"  # noqa: S608
                f" WHERE pipeline_id = %s AND epoch = %s RETURNING {_EPOCH_COLS}",
                (pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch, "to unpin")
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    def waiting_forks(self, pipeline_id: str, epoch: int | None = None) -> list[str]:
        """The forks of ``pipeline_id`` (of its ``epoch`` when given) that still need their fork point."""
        return self._db.tx(lambda cur: forks_waiting(cur, pipeline_id, epoch))

    def forks_of(self, pipeline_id: str) -> list[PipelineRecord]:
        """Every pipeline forked from ``pipeline_id``, by fork point then id."""

        def tx(cur: PgCursor) -> list[PipelineRecord]:
            cur.execute("SELECT * FROM arroyo_pipelines WHERE forked_from_pipeline = %s"
                        " ORDER BY forked_from_epoch, pipeline_id", (pipeline_id,))
            return [from_row(PipelineRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def fork_pipeline(self, source: str, epoch: int, new_id: str) -> PipelineRecord:
        """Fork pipeline ``new_id`` from completed ``epoch`` of ``source``, in one transaction under the
        source's row lock (retention's ``begin_prune`` takes the same lock, so a fork never races a prune).

        The fork's row is created ``stopped``, with no run, the source's stages, storage URI and config,
        ``last_epoch = epoch`` (its own epochs are numbered after the fork point) and the fork point
        recorded; nothing is copied: its first run restores the source's epoch, reading the source's snapshot
        objects where they are. The fork point is pinned in the source (label ``fork:<new_id>``; an epoch
        pinned already keeps its label) and cannot be unpinned while the fork still needs it
        (:meth:`unpin_epoch`).

        Idempotent: forking the same epoch to the same id again returns the fork. Raises
        :class:`ConfigurationError` for a bad id, :class:`StateConflictError` for a taken one or an epoch that is
        not completed,
        :class:`UnknownPipelineError` / :class:`UnknownEpochError` for unknown ones.
        """
        validate_pipeline_id(new_id)
        if new_id == source:
            raise ConfigurationError(f"a fork needs a new pipeline id, got the source's own ({source!r})")
        label = f"fork:{new_id}"[:PIN_LABEL_MAX]

        def tx(cur: PgCursor) -> PipelineRecord:
            src = lock_pipeline(cur, source)
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (source, epoch))
            found = cur.fetchone()
            if found is None:
                raise UnknownEpochError(source, epoch, "to fork from")
            cur.execute("SELECT * FROM arroyo_pipelines WHERE pipeline_id = %s", (new_id,))
            existing = cur.fetchone()
            if existing is not None:
                if existing["forked_from_pipeline"] == source and existing["forked_from_epoch"] == epoch:
                    return from_row(PipelineRecord, existing)  # a retried fork
                raise StateConflictError(
                    f"pipeline {new_id!r} already exists; fork to a new pipeline id (airflow-arroyo pipelines lists "
                    "the taken ones)"
                )
            if found["state"] != EpochState.COMPLETED.value:
                raise StateConflictError(
                    f"epoch {epoch} of pipeline {source!r} is {found['state']}, not completed: a fork starts by "
                    f"restoring its fork point, so fork from a completed epoch (airflow-arroyo epochs {source})"
                )
            cur.execute(
                "INSERT INTO arroyo_pipelines (pipeline_id, state, stages, storage_uri, checkpoint_interval_s,"
                " last_epoch, config, forked_from_pipeline, forked_from_epoch, forked_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, clock_timestamp()) RETURNING *",
                (new_id, PipelineState.STOPPED.value, src["stages"], src["storage_uri"], src["checkpoint_interval_s"],
                 epoch, json.dumps(src["config"] or {}), source, epoch),
            )
            fork = from_row(PipelineRecord, one(cur))
            cur.execute(
                "UPDATE arroyo_epochs SET pin_label = %s, pinned_at = clock_timestamp()"
                " WHERE pipeline_id = %s AND epoch = %s AND pin_label IS NULL",
                (label, source, epoch),
            )
            return fork

        return self._db.tx(tx)

    def commit_fork_restore(self, pipeline_id: str, run_id: str) -> PipelineRecord:
        """The commit point of a fork's first restore (run ``run_id`` restores the fork point, an epoch of
        another pipeline): under both pipelines' row locks, refused (``ConcurrencyConflict``) unless ``run_id``
        is the fork's current run, still ``registered``; refused (:class:`StateConflictError`) unless the fork still
        has no completed epoch of its own and its fork point is still completed in the source. Records
        ``restored_from_epoch`` (the fork point); no epoch changes: the source's are not the fork's to
        supersede. Repeatable until the fork completes an epoch."""

        def tx(cur: PgCursor) -> PipelineRecord:
            current = read_pipeline(cur, pipeline_id)
            source, epoch = current.forked_from_pipeline, current.forked_from_epoch
            if source is None or epoch is None:
                raise StateConflictError(f"pipeline {pipeline_id!r} is not a fork; nothing was changed")
            execute_prepared(cur, _LOCK_PIPELINES, (sorted([pipeline_id, source]),))
            rows = {r["pipeline_id"]: r for r in cur.fetchall()}
            fork = rows[pipeline_id]
            if fork["run_id"] != run_id or fork["state"] != PipelineState.REGISTERED.value:
                raise ConcurrencyConflict(
                    f"run {run_id!r} of pipeline {pipeline_id!r} cannot commit its restore of its fork point: the "
                    f"pipeline's current run is {fork['run_id']!r} ({fork['state']}); nothing was changed"
                )
            if pipeline_id not in forks_waiting(cur, source, epoch):
                raise StateConflictError(f"fork {pipeline_id!r} has completed epochs of its own: restore one of "
                                         "them (restore_from='latest'); nothing was changed")
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s", (source, epoch))
            row = cur.fetchone()
            if row is None or row["state"] != EpochState.COMPLETED.value:
                raise StateConflictError(
                    f"the fork point of {pipeline_id!r}, epoch {epoch} of {source!r}, is "
                    f"{row['state'] if row else 'gone'}, no longer completed (was it unpinned with --force and "
                    "pruned?); nothing was changed: fork again from a completed epoch"
                )
            cur.execute("UPDATE arroyo_pipelines SET restored_from_epoch = %s, updated_at = now()"
                        " WHERE pipeline_id = %s RETURNING *", (epoch, pipeline_id))
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

