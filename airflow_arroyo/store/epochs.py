"""Epochs and their acknowledgements: reading epochs, a stage's acknowledgement (which completes the epoch when
it is the last one expected), failing an epoch, and marking one unrestorable.

An acknowledgement answers with an :class:`~airflow_arroyo.store.records.AckResult` (as Flink's
``PendingCheckpoint.acknowledgeTask`` answers with a ``TaskAcknowledgeResult``): accepted, duplicate,
completed the epoch, or the epoch had already ended.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from airflow_arroyo.core.epochs import EPOCH_TRANSITIONS, EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownEpochError
from airflow_arroyo.store._db import Concern, PgCursor, one
from airflow_arroyo.store._transitions import transition
from airflow_arroyo.store.pipelines import check_token, lock_pipeline, read_pipeline
from airflow_arroyo.store.records import (
    AckOutcome,
    AckRecord,
    AckResult,
    EpochRecord,
    FencingToken,
    epoch_columns,
    from_row,
)

__all__ = ["Epochs"]

_EPOCH_COLS = epoch_columns()


class Epochs(Concern):
    """Epochs (``arroyo_epochs``) and the stages' acknowledgements (``arroyo_acks``)."""

    def get_epoch(self, pipeline_id: str, epoch: int) -> EpochRecord:
        """The epoch's record (:class:`UnknownEpochError` if none)."""

        def tx(cur: PgCursor) -> EpochRecord:
            cur.execute(f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s",  # noqa: S608
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch)
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    def list_epochs(self, pipeline_id: str, *, limit: int = 100, before: int | None = None,
                    states: Iterable[EpochState] | None = None) -> list[EpochRecord]:
        """Newest first, ``limit`` at most, epochs numbered below ``before`` when given."""
        state_list = [EpochState(s).value for s in states] if states is not None else None

        def tx(cur: PgCursor) -> list[EpochRecord]:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %(p)s"  # noqa: S608
                " AND (%(before)s::bigint IS NULL OR epoch < %(before)s)"
                " AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s))"
                " ORDER BY epoch DESC LIMIT %(limit)s",
                {"p": pipeline_id, "before": before, "states": state_list, "limit": limit},
            )
            rows = cur.fetchall()
            if not rows:
                read_pipeline(cur, pipeline_id)
            return [from_row(EpochRecord, r) for r in rows]

        return self._db.tx(tx)

    def in_flight_epoch(self, pipeline_id: str) -> EpochRecord | None:
        """The pipeline's epoch in flight (``triggered``), if any."""
        rows = self.list_epochs(pipeline_id, limit=1, states=[EpochState.TRIGGERED])
        return rows[0] if rows else None

    def latest_completed_epoch(self, pipeline_id: str) -> EpochRecord | None:
        """The newest completed epoch (what ``restore_from='latest'`` restores), if any."""
        rows = self.list_epochs(pipeline_id, limit=1, states=[EpochState.COMPLETED])
        return rows[0] if rows else None

    def mark_unrestorable(self, pipeline_id: str, epoch: int, reason: str, *,
                          token: FencingToken | None = None) -> None:
        """Record that a restore proved ``epoch`` can never be restored, and why (the first reason stays).
        Its state is not changed: it stays what it was for retention; ``'latest'`` and supervision read it."""

        def tx(cur: PgCursor) -> None:
            check_token(cur, token, f"marking epoch {epoch} unrestorable")
            cur.execute("UPDATE arroyo_epochs SET unrestorable = COALESCE(unrestorable, %s)"
                        " WHERE pipeline_id = %s AND epoch = %s", (reason[:4000], pipeline_id, epoch))
            if cur.rowcount == 0:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch, "to mark unrestorable")

        self._db.tx(tx)

    def oldest_completed_epoch(self, pipeline_id: str) -> EpochRecord | None:
        """The oldest epoch a restore can still pick (completed, not pruned or superseded)."""

        def tx(cur: PgCursor) -> EpochRecord | None:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND state = %s"  # noqa: S608
                " ORDER BY epoch LIMIT 1",
                (pipeline_id, EpochState.COMPLETED.value),
            )
            row = cur.fetchone()
            return from_row(EpochRecord, row) if row else None

        return self._db.tx(tx)

    def acknowledge(
        self,
        pipeline_id: str,
        epoch: int,
        stage: str,
        *,
        cursors: Mapping[str, int] | None = None,
        alignment_ms: float | None = None,
        sync_ms: float | None = None,
        async_ms: float | None = None,
        bytes_new: int | None = None,
        bytes_total: int | None = None,
        snapshot_uri: str | None = None,
        details: Mapping[str, Any] | None = None,
        token: FencingToken | None = None,
    ) -> AckResult:
        """Record a stage's acknowledgement (idempotent per stage); complete the epoch when it is the
        last one expected. Answers what the acknowledgement did (:class:`AckOutcome`: accepted, completed the
        epoch, a duplicate of the stage's first one, or too late: the epoch had already ended; kept for the
        record then, changing nothing) and the epoch's state afterwards.

        Raises :class:`UnknownEpochError` for an epoch the pipeline does not have, :class:`ConfigurationError`
        for a stage that is not one of the epoch's, :class:`FencedError` for a superseded run's ``token``."""

        def tx(cur: PgCursor) -> AckResult:
            # The pipeline's row lock first, like every other writer of epoch states: an ack that
            # completes the epoch must not race the trigger expiring it (the trigger's guarded UPDATE
            # would find no row), and the history must stay in commit order per pipeline.
            lock_pipeline(cur, pipeline_id)
            check_token(cur, token, f"the acknowledgement of epoch {epoch} by stage {stage!r}")
            cur.execute(
                "SELECT state, stages FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                (pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch, "to acknowledge")
            if stage not in row["stages"]:
                raise ConfigurationError(
                    f"stage {stage!r} is not one of the stages of epoch {epoch} of {pipeline_id!r} "
                    f"({', '.join(row['stages'])})"
                )
            cur.execute(
                "INSERT INTO arroyo_acks (pipeline_id, epoch, stage, cursors, alignment_ms, sync_ms, async_ms,"
                " bytes_new, bytes_total, snapshot_uri, details)"
                " VALUES (%s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s::jsonb)"
                " ON CONFLICT (pipeline_id, epoch, stage) DO NOTHING",
                (pipeline_id, epoch, stage, json.dumps(dict(cursors or {})), alignment_ms, sync_ms, async_ms,
                 bytes_new, bytes_total, snapshot_uri, json.dumps(dict(details or {}))),
            )
            recorded = cur.rowcount == 1
            state = EpochState(row["state"])
            if EpochState.COMPLETED not in EPOCH_TRANSITIONS[state]:
                return AckResult(AckOutcome.EPOCH_ENDED if recorded else AckOutcome.DUPLICATE, state)
            cur.execute(
                "SELECT count(*) AS n, COALESCE(sum(bytes_new), 0) AS bn, COALESCE(sum(bytes_total), 0) AS bt"
                " FROM arroyo_acks WHERE pipeline_id = %s AND epoch = %s AND stage = ANY(%s)",
                (pipeline_id, epoch, row["stages"]),
            )
            agg = one(cur)
            if int(agg["n"]) < len(set(row["stages"])):
                return AckResult(AckOutcome.ACCEPTED if recorded else AckOutcome.DUPLICATE, state)
            transition(cur, EpochState.COMPLETED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                       also="ended_at = clock_timestamp(), bytes_new = %(bn)s, bytes_total = %(bt)s",
                       params={"p": pipeline_id, "n": epoch, "bn": agg["bn"], "bt": agg["bt"]})
            return AckResult(AckOutcome.COMPLETED_EPOCH, EpochState.COMPLETED)

        return self._db.tx(tx)

    def ack_epoch(self, pipeline_id: str, epoch: int, stage: str, *, cursors: Mapping[str, int] | None = None,
                  alignment_ms: float | None = None, sync_ms: float | None = None, async_ms: float | None = None,
                  bytes_new: int | None = None, bytes_total: int | None = None, snapshot_uri: str | None = None,
                  details: Mapping[str, Any] | None = None, token: FencingToken | None = None) -> EpochState:
        """:meth:`acknowledge`, answering only the epoch's state afterwards (an acknowledgement for an epoch that
        already expired or failed is kept for the record and changes nothing)."""
        return self.acknowledge(pipeline_id, epoch, stage, cursors=cursors, alignment_ms=alignment_ms,
                                sync_ms=sync_ms, async_ms=async_ms, bytes_new=bytes_new, bytes_total=bytes_total,
                                snapshot_uri=snapshot_uri, details=details, token=token).state

    def fail_epoch(self, pipeline_id: str, epoch: int, reason: str, *, token: FencingToken | None = None) -> EpochState:
        """Mark an in-flight epoch failed (e.g. a stage could not snapshot). No-op if it already ended."""

        def tx(cur: PgCursor) -> EpochState:
            lock_pipeline(cur, pipeline_id)  # serialised with the trigger and cleanup, see acknowledge
            check_token(cur, token, f"failing epoch {epoch}")
            if transition(cur, EpochState.FAILED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                          also="ended_at = clock_timestamp(), failure_reason = %(reason)s",
                          params={"p": pipeline_id, "n": epoch, "reason": reason}):
                return EpochState.FAILED
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s",
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch)
            return EpochState(row["state"])

        return self._db.tx(tx)

    def acks(self, pipeline_id: str, epoch: int) -> list[AckRecord]:
        """The stages' acknowledgements of ``epoch``, in the order they came."""

        def tx(cur: PgCursor) -> list[AckRecord]:
            cur.execute("SELECT * FROM arroyo_acks WHERE pipeline_id = %s AND epoch = %s ORDER BY acked_at",
                        (pipeline_id, epoch))
            return [from_row(AckRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def unpruned_epochs(self, pipeline_id: str) -> list[EpochRecord]:
        """Every epoch of a pipeline not yet pruned, oldest first (input of the retention policy)."""

        def tx(cur: PgCursor) -> list[EpochRecord]:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND state <> 'pruned'"  # noqa: S608
                " ORDER BY epoch",
                (pipeline_id,),
            )
            rows = cur.fetchall()
            if not rows:
                read_pipeline(cur, pipeline_id)
            return [from_row(EpochRecord, r) for r in rows]

        return self._db.tx(tx)

