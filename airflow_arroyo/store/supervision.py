"""Supervision: the failures and restarts of a supervised lineage (``arroyo_restarts``) and the pipeline's
supervision state, decided by :mod:`airflow_arroyo.core.supervision` inside the transaction that records a failure."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

from airflow_arroyo.core.exceptions import ConcurrencyConflict, ConfigurationError, StateConflictError
from airflow_arroyo.core.supervision import (
    PastFailure,
    RestartDecision,
    SupervisionState,
    decide_restart,
    is_run_of,
    parse_strategy,
    restart_run_id,
    unrestorable_latest,
)
from airflow_arroyo.store._db import Concern, PgCursor, one
from airflow_arroyo.store.pipelines import lock_pipeline
from airflow_arroyo.store.records import PipelineRecord, RestartRecord, from_row

__all__ = ["Supervision"]

_SUPERVISING = (SupervisionState.WATCHING.value, SupervisionState.RESTARTING.value)


class Supervision(Concern):
    """What a supervisor records (Flink's ``CheckpointFailureManager`` and restart strategies, for runs)."""

    def supervise(self, pipeline_id: str, lineage: str, strategy: Mapping[str, Any]) -> PipelineRecord:
        """Put the pipeline's current run under supervision as lineage ``lineage`` (its first run id) with
        ``strategy`` (a strategy's dict, shown by the UI and the CLI). A supervision of that lineage still
        watching or restarting goes on (a retried task reattaching: its failures keep counting); otherwise
        a new one begins (``supervised_since``: its failures count from now). Raises
        :class:`ConcurrencyConflict` when the current run is not of that lineage (another run took over)."""

        def tx(cur: PgCursor) -> PipelineRecord:
            current = lock_pipeline(cur, pipeline_id)
            if not current["run_id"] or not is_run_of(current["run_id"], lineage):
                raise ConcurrencyConflict(
                    f"pipeline {pipeline_id!r} runs {current['run_id']!r}, not run {lineage!r} or a restart of it: "
                    "another submit took it over; this supervisor lets go")
            goes_on = current["supervised_run"] == lineage and current["supervision"] in _SUPERVISING
            cur.execute(
                "UPDATE arroyo_pipelines SET supervised_run = %s, restart_strategy = %s::jsonb,"
                " supervision = CASE WHEN %s THEN supervision ELSE 'watching' END,"
                " supervised_since = CASE WHEN %s THEN supervised_since ELSE clock_timestamp() END,"
                " updated_at = now() WHERE pipeline_id = %s RETURNING *",
                (lineage, json.dumps(dict(strategy)), goes_on, goes_on, pipeline_id),
            )
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

    @staticmethod
    def _supervised(pipeline_id: str, lineage: str, current: Mapping[str, Any]) -> datetime:
        """The current supervision of ``lineage`` (its ``supervised_since``), or ConcurrencyConflict."""
        if (current["supervised_run"] != lineage or current["supervised_since"] is None
                or not current["run_id"] or not is_run_of(current["run_id"], lineage)):
            raise ConcurrencyConflict(
                f"pipeline {pipeline_id!r} is run {current['run_id']!r} (supervised lineage "
                f"{current['supervised_run']!r}), not lineage {lineage!r}: another submit took it over")
        since: datetime = current["supervised_since"]
        return since

    def record_failure(self, pipeline_id: str, lineage: str, failed_run_id: str, cause: str,
                       decide: Callable[[list[PastFailure], datetime, bool], RestartDecision]) -> RestartRecord:
        """Record that run ``failed_run_id`` of a supervised lineage failed with ``cause``, and what
        ``decide`` (given this supervision's failures so far, this one last, the database's clock, and
        whether a stop was requested) made of it: the restart's delay, or giving up. Under the pipeline's
        row lock, so two triggerers noticing the same failure record it once: the second gets the first's
        row (also after a triggerer restart). Raises :class:`ConcurrencyConflict` when the pipeline is no
        longer this lineage's."""

        def tx(cur: PgCursor) -> RestartRecord:
            current = lock_pipeline(cur, pipeline_id)
            since = self._supervised(pipeline_id, lineage, current)
            return self._record_failure(cur, pipeline_id, lineage, since, failed_run_id, cause, decide, current)

        return self._db.tx(tx)

    @staticmethod
    def _record_failure(cur: PgCursor, pipeline_id: str, lineage: str, since: datetime, failed_run_id: str,
                        cause: str, decide: Callable[[list[PastFailure], datetime, bool], RestartDecision],
                        current: Mapping[str, Any]) -> RestartRecord:
        """:meth:`record_failure` inside a transaction that holds the pipeline's row lock."""
        cur.execute("SELECT * FROM arroyo_restarts WHERE pipeline_id = %s AND supervised_since = %s"
                    " AND failed_run_id = %s", (pipeline_id, since, failed_run_id))
        seen = cur.fetchone()
        if seen is not None:
            record = from_row(RestartRecord, seen)
        else:
            cur.execute("SELECT failed_at, restarted_at FROM arroyo_restarts WHERE pipeline_id = %s"
                        " AND lineage = %s AND supervised_since = %s ORDER BY attempt",
                        (pipeline_id, lineage, since))
            failures = [PastFailure(r["failed_at"], r["restarted_at"]) for r in cur.fetchall()]
            cur.execute("SELECT clock_timestamp() AS now")
            now = one(cur)["now"]
            failures.append(PastFailure(now))
            cur.execute("SELECT epoch, unrestorable FROM arroyo_epochs WHERE pipeline_id = %s"
                        " AND state = 'completed' ORDER BY epoch DESC LIMIT 1", (pipeline_id,))
            latest = cur.fetchone()
            if latest is not None and latest["unrestorable"] and not current["stop_requested"]:
                decision = unrestorable_latest(latest["epoch"], latest["unrestorable"])
            else:
                decision = decide(failures, now, bool(current["stop_requested"]))
            cur.execute(
                "INSERT INTO arroyo_restarts (pipeline_id, lineage, supervised_since, attempt, failed_run_id,"
                " cause, failed_at, delay_s, gave_up, decision) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " RETURNING *",
                (pipeline_id, lineage, since, len(failures), failed_run_id, cause[:4000], now,
                 decision.delay if decision.restart else 0.0, not decision.restart, decision.reason),
            )
            record = from_row(RestartRecord, one(cur))
        if record.new_run_id is None:  # decided, not restarted yet: the pipeline says what comes next
            state = SupervisionState.GAVE_UP if record.gave_up else SupervisionState.RESTARTING
            cur.execute("UPDATE arroyo_pipelines SET supervision = %s, updated_at = now()"
                        " WHERE pipeline_id = %s AND supervision IS DISTINCT FROM %s",
                        (state.value, pipeline_id, state.value))
        return record

    def expire_restart(self, pipeline_id: str, grace: float) -> RestartRecord | None:
        """Declare failed a restart of the supervised lineage that did not register within ``grace`` seconds of
        being due (its delay after the failure) or of being submitted: the worker submitting it may have died
        between the failure and the registration, and nothing else would ever end the supervision's wait. The
        restart's run is recorded as the lineage's next failure, which the recorded strategy decides on: a
        restart again (a supervisor still alive submits it) or giving up (the wait ends, failed). None when no
        restart is overdue: none is due or submitted, the restart's run registered, or the supervision ended."""
        if not isinstance(grace, int | float) or isinstance(grace, bool) or grace < 0:
            raise ConfigurationError(f"grace must be a number of seconds >= 0, got {grace!r}")

        def tx(cur: PgCursor) -> RestartRecord | None:
            current = lock_pipeline(cur, pipeline_id)
            lineage, since = current["supervised_run"], current["supervised_since"]
            if (current["supervision"] not in _SUPERVISING or not lineage or since is None
                    or not current["run_id"] or not is_run_of(current["run_id"], lineage)):
                return None
            cur.execute("SELECT * FROM arroyo_restarts WHERE pipeline_id = %s AND lineage = %s"
                        " AND supervised_since = %s ORDER BY attempt DESC LIMIT 1", (pipeline_id, lineage, since))
            row = cur.fetchone()
            if row is None or row["gave_up"]:
                return None
            if row["new_run_id"] is None:
                if current["supervision"] != SupervisionState.RESTARTING.value:
                    return None
                start, what = row["failed_at"] + timedelta(seconds=float(row["delay_s"] or 0.0)), "was due"
            else:
                start, what = row["restarted_at"], "was submitted"
            # a restart registered when the current run is none of the failed ones, or registered (or beat) since
            cur.execute("SELECT 1 FROM arroyo_restarts WHERE pipeline_id = %s AND lineage = %s"
                        " AND supervised_since = %s AND failed_run_id = %s",
                        (pipeline_id, lineage, since, current["run_id"]))
            beat = current["heartbeat_at"]
            if cur.fetchone() is None or (beat is not None and beat >= start):
                return None
            cur.execute("SELECT clock_timestamp() AS now")
            if one(cur)["now"] < start + timedelta(seconds=grace):
                return None
            run = row["new_run_id"] or restart_run_id(lineage, int(row["attempt"]))
            cause = (f"restart {row['attempt']} (run {run}) {what} at {start:%Y-%m-%d %H:%M:%S %Z} and did not "
                     f"register within {grace:g}s: the worker submitting it may have died")
            strategy = parse_strategy(current["restart_strategy"])

            def decide(failures: list[PastFailure], now: datetime, stop_requested: bool) -> RestartDecision:
                if strategy is None:
                    return RestartDecision(False, 0.0, "no restart strategy is recorded for the lineage")
                return decide_restart(strategy, failures, now, lineage=lineage, stop_requested=stop_requested)

            return self._record_failure(cur, pipeline_id, lineage, since, run, cause, decide, current)

        return self._db.tx(tx)

    def claim_restart(self, pipeline_id: str, lineage: str, attempt: int) -> str | None:
        """Whether restart ``attempt`` of the lineage may be submitted now: None if so, else why not (a stop
        was requested since the failure, the supervision ended or moved on, another run took over)."""

        def tx(cur: PgCursor) -> str | None:
            current = lock_pipeline(cur, pipeline_id)
            try:
                since = self._supervised(pipeline_id, lineage, current)
            except ConcurrencyConflict as exc:
                return str(exc)
            if current["stop_requested"]:
                return f"a stop ({current['stop_requested']}) was requested while the restart was due"
            if current["supervision"] != SupervisionState.RESTARTING.value:
                return f"the supervision is {current['supervision']}, not restarting"
            cur.execute("SELECT new_run_id, gave_up FROM arroyo_restarts WHERE pipeline_id = %s AND lineage = %s"
                        " AND supervised_since = %s AND attempt = %s", (pipeline_id, lineage, since, attempt))
            row = cur.fetchone()
            if row is None or row["gave_up"] or row["new_run_id"] is not None:
                return f"failure {attempt} is not one whose restart is due"
            return None

        return self._db.tx(tx)

    def record_restart(self, pipeline_id: str, lineage: str, attempt: int, new_run_id: str,
                       restored_epoch: int | None) -> RestartRecord:
        """Record that restart ``attempt`` of the lineage's current supervision was submitted as run
        ``new_run_id``, restoring ``restored_epoch`` (None: no completed epoch, a start over); the
        supervisor watches again."""

        def tx(cur: PgCursor) -> RestartRecord:
            current = lock_pipeline(cur, pipeline_id)
            cur.execute(
                "UPDATE arroyo_restarts SET new_run_id = %s, restored_epoch = %s,"
                " restarted_at = COALESCE(restarted_at, clock_timestamp())"
                " WHERE pipeline_id = %s AND lineage = %s AND supervised_since = %s AND attempt = %s RETURNING *",
                (new_run_id, restored_epoch, pipeline_id, lineage, current["supervised_since"], attempt),
            )
            row = cur.fetchone()
            if row is None:
                raise StateConflictError(f"pipeline {pipeline_id!r} lineage {lineage!r} has no failure {attempt} "
                                         "recorded to restart after")
            cur.execute("UPDATE arroyo_pipelines SET supervision = 'watching', updated_at = now()"
                        " WHERE pipeline_id = %s AND supervised_run = %s AND supervision = 'restarting'",
                        (pipeline_id, lineage))
            return from_row(RestartRecord, row)

        return self._db.tx(tx)

    def end_supervision(self, pipeline_id: str, lineage: str,
                        state: SupervisionState = SupervisionState.ENDED) -> None:
        """The supervisor of ``lineage`` lets go (the pipeline stopped, a stop cancelled a restart, it gave up
        or failed itself): a failed run of it is no longer coming back. A no-op when another lineage is
        supervised meanwhile."""
        self._db.tx(lambda cur: cur.execute(
            "UPDATE arroyo_pipelines SET supervision = %s, updated_at = now()"
            " WHERE pipeline_id = %s AND supervised_run = %s", (state.value, pipeline_id, lineage)))

    def restarts(self, pipeline_id: str, lineage: str | None = None, limit: int = 200) -> list[RestartRecord]:
        """The failures and restarts a supervisor recorded for the pipeline, newest first (of one lineage,
        or of all)."""

        def tx(cur: PgCursor) -> list[RestartRecord]:
            cur.execute(
                "SELECT * FROM arroyo_restarts WHERE pipeline_id = %s AND (%s::text IS NULL OR lineage = %s)"
                " ORDER BY failed_at DESC, attempt DESC LIMIT %s",
                (pipeline_id, lineage, lineage, int(limit)),
            )
            return [from_row(RestartRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def restart_counts(self) -> dict[str, int]:
        """How many times each supervised pipeline's current lineage was restarted (resubmitted after a
        failure; a failure the strategy gave up on, or whose restart is still due, does not count). Only
        pipelines with a supervision state are in it: a pipeline never supervised, or whose current run is
        not of the lineage it recorded, has no count."""

        def tx(cur: PgCursor) -> dict[str, int]:
            cur.execute(
                "SELECT p.pipeline_id, count(r.restarted_at) AS restarts FROM arroyo_pipelines p"
                " LEFT JOIN arroyo_restarts r ON r.pipeline_id = p.pipeline_id AND r.lineage = p.supervised_run"
                " AND r.supervised_since = p.supervised_since"
                " WHERE p.supervision IS NOT NULL GROUP BY p.pipeline_id"
            )
            return {r["pipeline_id"]: int(r["restarts"]) for r in cur.fetchall()}

        return self._db.tx(tx)

