"""Pipelines and their runs: registration, the restore's commit point, run failure, state changes, heartbeats,
stop requests, and fencing (a run's writes refused once a newer generation registered).

The functions at module level run inside a caller's transaction: every concern of the store that writes
for a pipeline takes its row lock (:func:`lock_pipeline`) first, and checks a run's fencing token
(:func:`check_token`) with its write.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_arroyo.core.epochs import EpochState, PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import (
    ConcurrencyConflict,
    ConfigurationError,
    FencedError,
    IllegalTransitionError,
    StateConflictError,
    UnknownPipelineError,
)
from airflow_arroyo.core.supervision import is_run_of
from airflow_arroyo.store._db import Concern, PgCursor, one, positive_seconds
from airflow_arroyo.store._transitions import transition
from airflow_arroyo.store.records import FencingToken, PipelineRecord, from_row

__all__ = ["Pipelines", "check_token", "fail_in_flight", "lock_pipeline", "read_pipeline"]


def lock_pipeline(cur: PgCursor, pipeline_id: str) -> dict[str, Any]:
    """The pipeline's row, locked until the transaction ends (:class:`UnknownPipelineError` if none)."""
    cur.execute("SELECT * FROM arroyo_pipelines WHERE pipeline_id = %s FOR UPDATE", (pipeline_id,))
    row = cur.fetchone()
    if row is None:
        raise UnknownPipelineError(pipeline_id)
    return dict(row)


def read_pipeline(cur: PgCursor, pipeline_id: str) -> PipelineRecord:
    """The pipeline's record, not locked (:class:`UnknownPipelineError` if none)."""
    cur.execute("SELECT * FROM arroyo_pipelines WHERE pipeline_id = %s", (pipeline_id,))
    row = cur.fetchone()
    if row is None:
        raise UnknownPipelineError(pipeline_id)
    return from_row(PipelineRecord, row)


def check_token(cur: PgCursor, token: FencingToken | None, what: str) -> None:
    """Fencing: refuse (:class:`FencedError`) a write of a run that is no longer the pipeline's current
    generation. The row is share-locked until the transaction ends, so a registration (which updates
    the row) waits for the write, and a write after a registration sees the new generation."""
    if token is None:
        return
    cur.execute("SELECT run_id, generation FROM arroyo_pipelines WHERE pipeline_id = %s FOR SHARE",
                (token.pipeline_id,))
    row = cur.fetchone()
    if row is None:
        raise UnknownPipelineError(token.pipeline_id)
    if int(row["generation"]) != token.generation or row["run_id"] != token.run_id:
        raise FencedError(token.pipeline_id, token.run_id, token.generation, by_run=row["run_id"],
                          by_generation=int(row["generation"]), what=what)


def fail_in_flight(cur: PgCursor, pipeline_id: str, reason: str) -> int | None:
    """Fail the pipeline's in-flight epoch, if any (the only state that may become failed)."""
    rows = transition(cur, EpochState.FAILED, where="e.pipeline_id = %(p)s",
                      also="ended_at = clock_timestamp(), failure_reason = %(reason)s",
                      params={"p": pipeline_id, "reason": reason}, returning="e.epoch")
    return int(rows[0]["epoch"]) if rows else None


class Pipelines(Concern):
    """Pipelines, runs and fencing (``arroyo_pipelines``)."""

    def fencing_token(self, pipeline_id: str, run_id: str) -> FencingToken:
        """The fencing token of run ``run_id`` (call it right after registering it);
        :class:`FencedError` if another run registered since."""

        def tx(cur: PgCursor) -> FencingToken:
            record = read_pipeline(cur, pipeline_id)
            if record.run_id != run_id:
                raise FencedError(pipeline_id, run_id, -1, by_run=record.run_id, by_generation=record.generation,
                                  what="taking its fencing token")
            return record.token

        return self._db.tx(tx)

    def register_pipeline(
        self,
        pipeline_id: str,
        *,
        stages: Sequence[str],
        run_id: str,
        channels: Mapping[str, str] | None = None,
        storage_uri: str | None = None,
        checkpoint_interval: float | None = None,
        spark_app_id: str | None = None,
        spark_ui_url: str | None = None,
        config: Mapping[str, Any] | None = None,
        takeover: bool = False,
    ) -> PipelineRecord:
        """Register a new run of a pipeline (state ``registered``, ``restored_from_epoch`` unset).

        A pipeline whose previous run stopped or failed starts a new run. A pipeline still
        registered/running/stopping is refused (two drivers would fight) unless ``takeover``:
        then the old run is marked failed ("superseded") and its in-flight epoch failed.

        Registering changes no epoch. A run that restores an epoch registers first (so that it owns the
        pipeline before it touches storage), prepares and verifies everything the restore needs, and
        only then calls :meth:`commit_restore`, the restore's commit point in the store: a restore that
        fails or is killed before it leaves every epoch as it was.
        """
        validate_pipeline_id(pipeline_id)
        if not stages:
            raise ConfigurationError(f"pipeline {pipeline_id!r} has no stages; a pipeline needs at least one")
        if checkpoint_interval is not None:
            positive_seconds(checkpoint_interval, "checkpoint interval")
        params = {
            "pipeline_id": pipeline_id, "run_id": run_id, "stages": list(stages),
            "channels": json.dumps(dict(channels or {})), "storage_uri": storage_uri,
            "interval": checkpoint_interval, "spark_app_id": spark_app_id, "spark_ui_url": spark_ui_url,
            "config": json.dumps(dict(config or {})),
        }

        def tx(cur: PgCursor) -> PipelineRecord:
            cur.execute(
                "INSERT INTO arroyo_pipelines (pipeline_id, state, run_id, stages, channels, storage_uri,"
                " checkpoint_interval_s, spark_app_id, spark_ui_url, restored_from_epoch, config, heartbeat_at)"
                " VALUES (%(pipeline_id)s, 'registered', %(run_id)s, %(stages)s, %(channels)s::jsonb,"
                " %(storage_uri)s, %(interval)s, %(spark_app_id)s, %(spark_ui_url)s, NULL,"
                " %(config)s::jsonb, clock_timestamp())"
                " ON CONFLICT (pipeline_id) DO NOTHING RETURNING *",
                params,
            )
            row = cur.fetchone()
            if row is not None:
                return from_row(PipelineRecord, row)
            current = lock_pipeline(cur, pipeline_id)
            state = PipelineState(current["state"])
            if not state.terminal:
                if current["run_id"] == run_id:
                    raise ConcurrencyConflict(f"run {run_id!r} of pipeline {pipeline_id!r} is already registered")
                if not takeover:
                    raise ConcurrencyConflict(
                        f"pipeline {pipeline_id!r} is {state} (run {current['run_id']!r}, last heartbeat "
                        f"{current['heartbeat_at']}); stop it first, or register with takeover=True if that "
                        "driver is dead"
                    )
                fail_in_flight(cur, pipeline_id, f"run {current['run_id']} superseded by run {run_id}")
                transition(cur, PipelineState.FAILED, where="p.pipeline_id = %(p)s",
                           also="failure_cause = %(cause)s, updated_at = now()",
                           params={"p": pipeline_id, "cause": f"superseded by run {run_id}"})
            rows = transition(
                cur, PipelineState.REGISTERED, where="p.pipeline_id = %(pipeline_id)s",
                also="run_id = %(run_id)s, stages = %(stages)s,"
                " channels = %(channels)s::jsonb, storage_uri = %(storage_uri)s,"
                " checkpoint_interval_s = COALESCE(%(interval)s, p.checkpoint_interval_s),"
                " spark_app_id = %(spark_app_id)s,"
                " spark_ui_url = %(spark_ui_url)s, restored_from_epoch = NULL, config = %(config)s::jsonb,"
                " failure_cause = NULL, stop_requested = NULL, heartbeat_at = clock_timestamp(),"
                " supervision = CASE WHEN %(same_lineage)s THEN p.supervision END,"
                " updated_at = now()",
                params={**params, "same_lineage": is_run_of(run_id, current["supervised_run"])}, returning="p.*",
            )
            if not rows:  # cannot be: the row is locked and its run ended (or was just failed above)
                raise IllegalTransitionError("pipeline", current["state"], PipelineState.REGISTERED.value,
                                             subject=pipeline_id)
            return from_row(PipelineRecord, rows[0])

        return self._db.tx(tx)

    def commit_restore(self, pipeline_id: str, run_id: str, epoch: int) -> PipelineRecord:
        """The commit point of run ``run_id``'s restore of ``epoch``, in one transaction under the pipeline's
        row lock: the completed epochs after ``epoch`` become ``superseded`` (the restore then cuts every
        channel right after barrier ``epoch``, so they can never be restored again; "latest completed" and
        retention's guarantees mean ``epoch`` until the run completes one) and ``restored_from_epoch`` is
        recorded.

        Call it only once the restore has verified everything it needs (every stage's checkpoint rebuilt
        and verified, every channel's barrier found, every sink's cut known) and before it changes anything
        it cannot undo. Refused (``ConcurrencyConflict``) unless ``run_id`` is the pipeline's current run,
        still ``registered``; refused (:class:`StateConflictError`) unless ``epoch`` is still ``completed`` (e.g.
        retention pruned it meanwhile). Idempotent: a later run that finishes a restore cut short after this
        commit restores the same epoch (now the latest completed) and commits it again.
        """

        def tx(cur: PgCursor) -> PipelineRecord:
            current = lock_pipeline(cur, pipeline_id)
            if current["run_id"] != run_id or current["state"] != PipelineState.REGISTERED.value:
                raise ConcurrencyConflict(
                    f"run {run_id!r} of pipeline {pipeline_id!r} cannot commit its restore of epoch {epoch}: the "
                    f"pipeline's current run is {current['run_id']!r} ({current['state']}); nothing was changed"
                )
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s", (pipeline_id, epoch))
            row = cur.fetchone()
            state = row["state"] if row is not None else None
            if state != EpochState.COMPLETED.value:
                raise StateConflictError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is {state or 'unknown'}, no longer completed (did "
                    "retention prune it during the restore?); nothing was changed: restore from a completed epoch"
                )
            transition(cur, EpochState.SUPERSEDED, where="e.pipeline_id = %(p)s AND e.epoch > %(n)s",
                       also="failure_reason = %(reason)s",
                       params={"p": pipeline_id, "n": epoch,
                               "reason": f"superseded: run {run_id} restored the older epoch {epoch}"})
            _settle_gates_on_restore(cur, pipeline_id, epoch)
            cur.execute(
                "UPDATE arroyo_pipelines SET restored_from_epoch = %s, updated_at = now()"
                " WHERE pipeline_id = %s RETURNING *",
                (epoch, pipeline_id),
            )
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

    def fail_run(self, pipeline_id: str, run_id: str, cause: str, *,
                 never_registered: bool = False) -> PipelineRecord | None:
        """Record that run ``run_id`` is gone without its driver saying so (its ``spark-submit`` exited, its
        cluster application ended, its submit gave up on it): in one transaction under the pipeline's row
        lock the run becomes ``failed`` with ``cause`` and its in-flight epoch ``failed``, so that nothing
        waits for the epoch's timeout or for the heartbeat to go stale. Only while ``run_id`` is the
        pipeline's current, live run. Returns the failed record, or None when there was nothing to fail (the
        run ended already, or another run is current).

        ``never_registered``: the submit of ``run_id`` failed before its driver registered it (say, a
        pipeline module the driver cannot import). When the pipeline is unknown, or its current run is
        another one that has ended, ``run_id`` becomes its current run, registered and failed with ``cause``
        in this transaction (a new generation; the pipeline's stages, channels and storage are kept), so that
        whoever waits for that run (the checkpoint controller, a sensor) learns it at once. A live other run
        is left alone."""
        cause = cause[:4000]

        def tx(cur: PgCursor) -> PipelineRecord | None:
            if never_registered:
                cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state, run_id, heartbeat_at)"
                            " VALUES (%s, 'registered', %s, NULL) ON CONFLICT (pipeline_id) DO NOTHING",
                            (pipeline_id, run_id))
            try:
                current = lock_pipeline(cur, pipeline_id)
            except UnknownPipelineError:
                return None
            state = PipelineState(current["state"])
            if current["run_id"] != run_id:
                if not (never_registered and state.terminal):
                    return None
                transition(cur, PipelineState.REGISTERED, where="p.pipeline_id = %(p)s",
                           also="run_id = %(run)s, spark_app_id = NULL, spark_ui_url = NULL, heartbeat_at = NULL,"
                                " restored_from_epoch = NULL, stop_requested = NULL, failure_cause = NULL,"
                                " supervision = CASE WHEN %(same_lineage)s THEN p.supervision END,"
                                " updated_at = now()",
                           params={"p": pipeline_id, "run": run_id,
                                   "same_lineage": is_run_of(run_id, current["supervised_run"])})
            elif state.terminal:
                return None
            fail_in_flight(cur, pipeline_id, f"run {run_id} failed: {cause.splitlines()[0] if cause else ''}")
            rows = transition(cur, PipelineState.FAILED, where="p.pipeline_id = %(p)s",
                              also="failure_cause = %(cause)s, updated_at = now()",
                              params={"p": pipeline_id, "cause": cause}, returning="p.*")
            return from_row(PipelineRecord, rows[0]) if rows else None

        return self._db.tx(tx)

    def set_pipeline_state(self, pipeline_id: str, target: PipelineState, *, run_id: str | None = None,
                           failure_cause: str | None = None) -> PipelineRecord:
        """Move the pipeline to ``target`` if the transition table allows it (and, given ``run_id``,
        only if that run is the current one). Stopping or failing fails the in-flight epoch."""
        target = PipelineState(target)

        def tx(cur: PgCursor) -> PipelineRecord:
            current = lock_pipeline(cur, pipeline_id)
            if run_id is not None and current["run_id"] != run_id:
                raise FencedError(pipeline_id, run_id, -1, by_run=current["run_id"],
                                  by_generation=current.get("generation"), what=f"the state change to {target.value}")
            if target.terminal:
                fail_in_flight(cur, pipeline_id, f"pipeline {target.value}")
            rows = transition(cur, target, where="p.pipeline_id = %(p)s",
                              also="failure_cause = COALESCE(%(cause)s, p.failure_cause), updated_at = now()",
                              params={"p": pipeline_id, "cause": failure_cause}, returning="p.*")
            if not rows:  # refused by the guard: the transaction (and the epoch failed above) rolls back
                raise IllegalTransitionError("pipeline", current["state"], target.value, subject=pipeline_id)
            return from_row(PipelineRecord, rows[0])

        return self._db.tx(tx)

    def heartbeat(self, pipeline_id: str, run_id: str, *, spark_app_id: str | None = None,
                  spark_ui_url: str | None = None, token: FencingToken | None = None) -> PipelineRecord:
        """Record that run ``run_id`` is alive; :class:`FencedError` once another run registered (with
        ``token``: once another generation did, even of the same run id)."""
        generation = token.generation if token is not None else None

        def tx(cur: PgCursor) -> PipelineRecord:
            cur.execute(
                "UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp(),"
                " spark_app_id = COALESCE(%s, spark_app_id), spark_ui_url = COALESCE(%s, spark_ui_url)"
                " WHERE pipeline_id = %s AND run_id = %s AND (%s::bigint IS NULL OR generation = %s::bigint)"
                " RETURNING *",
                (spark_app_id, spark_ui_url, pipeline_id, run_id, generation, generation),
            )
            row = cur.fetchone()
            if row is None:
                current = read_pipeline(cur, pipeline_id)  # raises UnknownPipelineError
                raise FencedError(pipeline_id, run_id, -1 if generation is None else generation,
                                  by_run=current.run_id, by_generation=current.generation, what="the heartbeat")
            return from_row(PipelineRecord, row)

        return self._db.tx(tx)

    def request_stop(self, pipeline_id: str, mode: str = "graceful") -> PipelineRecord:
        """Ask the running pipeline to stop: ``graceful`` takes a final epoch first, ``immediate`` does not."""
        if mode not in ("graceful", "immediate"):
            raise ConfigurationError(f"stop mode must be 'graceful' or 'immediate', got {mode!r}")

        def tx(cur: PgCursor) -> PipelineRecord:
            lock_pipeline(cur, pipeline_id)
            cur.execute(
                "UPDATE arroyo_pipelines SET stop_requested = %s, updated_at = now()"
                " WHERE pipeline_id = %s RETURNING *",
                (mode, pipeline_id),
            )
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

    def record_checkpoint_interval(self, pipeline_id: str, run_id: str, interval: float) -> PipelineRecord:
        """Record the checkpoint interval the controller of run ``run_id`` fires epochs at (the UI's
        Interval column, and the clock of the "checkpoints overdue" warning when that controller dies).
        A run that is no longer current is left alone."""
        positive_seconds(interval, "checkpoint interval")

        def tx(cur: PgCursor) -> PipelineRecord:
            cur.execute(
                "UPDATE arroyo_pipelines SET checkpoint_interval_s = %s"
                " WHERE pipeline_id = %s AND run_id = %s RETURNING *",
                (float(interval), pipeline_id, run_id),
            )
            row = cur.fetchone()
            return from_row(PipelineRecord, row) if row is not None else read_pipeline(cur, pipeline_id)

        return self._db.tx(tx)

    def get_pipeline(self, pipeline_id: str) -> PipelineRecord:
        """The pipeline's record (:class:`UnknownPipelineError` if none)."""
        return self._db.tx(lambda cur: read_pipeline(cur, pipeline_id))

    def list_pipelines(self) -> list[PipelineRecord]:
        """Every pipeline's record, by id."""

        def tx(cur: PgCursor) -> list[PipelineRecord]:
            cur.execute("SELECT * FROM arroyo_pipelines ORDER BY pipeline_id")
            return [from_row(PipelineRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)


_OPEN_GATES = ["failed", "passed", "pending", "timed_out"]  # airflow_arroyo.core.gates.OPEN_GATE_STATES


def _settle_gates_on_restore(cur: PgCursor, pipeline_id: str, epoch: int) -> None:
    """The commit gates' part of a restore's commit of ``epoch`` (here, not in store/gates.py, which builds on this
    module): passed gates up to it are committed by the restore's rollback, and every open gate after it is
    superseded (its epoch's output is recomputed under a new gate)."""
    cur.execute("UPDATE arroyo_gates SET state = 'committed', closed_at = clock_timestamp()"
                " WHERE pipeline_id = %s AND epoch <= %s AND state = 'passed'", (pipeline_id, epoch))
    cur.execute("UPDATE arroyo_gates SET state = 'superseded', closed_at = clock_timestamp(),"
                " reason = COALESCE(reason, %s) WHERE pipeline_id = %s AND epoch > %s AND state = ANY(%s)",
                (f"superseded: the pipeline restored the older epoch {epoch}", pipeline_id, epoch, _OPEN_GATES))
