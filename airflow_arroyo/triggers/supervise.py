"""``PipelineSupervisorTrigger``: watch a supervised pipeline run in the triggerer, for its whole life.

The submit operator, given a ``restart_strategy``, defers to it once its run is ``running`` (and after
each restart it submits). No worker slot is held meanwhile. It looks at the epoch store every
``poll_interval`` seconds and yields exactly one event::

    {"status": "stopped" | "restart" | "gave_up" | "cancelled" | "superseded" | "error",
     "pipeline_id", "lineage", "run_id", "attempt", "cause", "delay", "message", "latest_epoch"}

* ``stopped``: the lineage's run stopped (a stop operator, the CLI, ``stop_after_epochs``): the task
  succeeds.
* ``restart``: the run failed (its driver reported ``failed``; its heartbeat is older than
  ``heartbeat_timeout``; the local ``spark-submit`` exited; the cluster manager says the application
  ended; or a restarted run did not reach ``running`` by ``start_deadline``), the failure was recorded
  (``arroyo_restarts``) and the strategy's delay has passed: the operator resubmits, restoring the
  latest completed epoch, and defers here again. With ``restart_submit`` (the operator's
  ``restart_in_triggerer``) there is no such event: the trigger ends the failed run, submits the restart
  itself (:mod:`airflow_arroyo.triggers.resubmit`), records it and goes on supervising the new run in the
  same ``run()``; no worker slot is needed. A trigger re-created from its arguments after that (a triggerer
  restarted) takes up the lineage's newest restart. A run whose spark-submit or cluster application ended
  is marked ``failed`` with its in-flight epoch at once (its exit wakes the trigger: a pidfd, on Linux),
  so that nothing waits for its heartbeat to go stale or for the epoch's timeout.
* ``gave_up``: the strategy gave up on the failure; ``cause`` is the last failure's: the task fails.
* ``cancelled``: the run failed while a stop was requested, or a stop came during the backoff: no
  restart; the task succeeds (the stop is honoured).
* ``superseded``: another run (not of this lineage) took the pipeline over: this supervisor lets go.
* ``error``: the epoch store failed beyond its retries, or was unreachable for longer than
  ``heartbeat_timeout``.

The decision itself is :func:`airflow_arroyo.core.supervision.decide_restart`'s, taken inside the store's
transaction that records the failure (:meth:`~airflow_arroyo.store.EpochStore.record_failure`), so two
triggerers running this trigger, or one restarted during a backoff, record one failure once and wait
out the same delay.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_arroyo.core.epochs import PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConcurrencyConflict,
    ConfigurationError,
    TransientStoreError,
    UnknownPipelineError,
)
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.supervision import (
    PastFailure,
    RestartDecision,
    SupervisionState,
    decide_restart,
    in_lineage,
    parse_strategy,
    restart_run_id,
)
from airflow_arroyo.store import AsyncEpochStore, PipelineRecord, RestartRecord
from airflow_arroyo.triggers.pipeline import WatchesSubmission, log_tail, open_async_store
from airflow_arroyo.triggers.resubmit import Resubmission, end_failed_run, launch, log_path_of, restart_attempt
from airflow_arroyo.triggers.settle import hold_until

__all__ = ["PipelineSupervisorTrigger"]

_HEARTBEATING = (PipelineState.RUNNING, PipelineState.STOPPING)  # a registered run restores: start_deadline


class PipelineSupervisorTrigger(WatchesSubmission, BaseTrigger):
    """Supervise run ``run_id`` of lineage ``lineage`` of a pipeline: end when it stops, restart it
    (through the operator) when it fails, as ``strategy`` decides.

    :param pipeline_id: the pipeline.
    :param lineage: the first run id of the supervised chain of runs.
    :param run_id: the run watched now (the lineage itself, or its latest restart).
    :param strategy: the restart strategy's dict (:func:`~airflow_arroyo.core.supervision.parse_strategy`).
    :param conn_id: Airflow connection of the epoch store.
    :param poll_interval: seconds between two looks at the store.
    :param heartbeat_timeout: a live run silent for this many seconds has failed.
    :param start_deadline: UNIX time by which ``run_id`` must be running (a restart just submitted);
        None once it ran.
    :param submit_pid/submit_host/submit_start_ticks/submit_log/submit_exits: the local ``spark-submit``
        of ``run_id``, as in :class:`~airflow_arroyo.triggers.pipeline.PipelineStateTrigger`.
    :param cluster_application: a cluster-mode run's handle; its end is a failure.
    :param not_before: UNIX time before which no event is yielded (the deferral's settle time).
    :param restart_submit: a :class:`~airflow_arroyo.triggers.resubmit.Resubmission` as a dict: submit restarts
        from here instead of yielding ``restart`` (no secret in it; the DSN is read from ``conn_id`` then).
    :param register_timeout: seconds a restart submitted from here may take to reach ``running``.
    """

    def __init__(
        self,
        pipeline_id: str,
        lineage: str,
        run_id: str,
        strategy: dict[str, Any],
        conn_id: str = "arroyo_default",
        poll_interval: float = 2.0,
        heartbeat_timeout: float = 60.0,
        start_deadline: float | None = None,
        submit_pid: int | None = None,
        submit_host: str | None = None,
        submit_start_ticks: int | None = None,
        submit_log: str | None = None,
        submit_exits: bool = False,
        cluster_application: dict[str, Any] | None = None,
        cluster_poll_interval: float = 30.0,
        not_before: float | None = None,
        restart_submit: dict[str, Any] | None = None,
        register_timeout: float = 600.0,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        validate_pipeline_id(pipeline_id)
        parsed = parse_strategy(strategy)
        if parsed is None:
            raise ConfigurationError("PipelineSupervisorTrigger needs a restart strategy")
        if poll_interval <= 0 or heartbeat_timeout <= 0:
            raise ConfigurationError("poll_interval and heartbeat_timeout must be positive numbers of seconds")
        self.pipeline_id = pipeline_id
        self.lineage = lineage
        self.run_id = run_id
        self.strategy = parsed.to_dict()
        self._strategy = parsed
        self.conn_id = conn_id
        self.poll_interval = float(poll_interval)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.start_deadline = start_deadline
        self._watch_submission(submit_pid, submit_host, submit_start_ticks, submit_log, submit_exits,
                               cluster_application, cluster_poll_interval)
        self.not_before = not_before
        self.restart_submit = dict(restart_submit) if restart_submit else None
        self._resubmission = Resubmission.from_dict(self.restart_submit)
        self.register_timeout = float(register_timeout)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "pipeline_id": self.pipeline_id, "lineage": self.lineage, "run_id": self.run_id,
                "strategy": self.strategy, "conn_id": self.conn_id, "poll_interval": self.poll_interval,
                "heartbeat_timeout": self.heartbeat_timeout, "start_deadline": self.start_deadline,
                **self._submission_kwargs(), "not_before": self.not_before,
                "restart_submit": self.restart_submit, "register_timeout": self.register_timeout,
            },
        )

    def _event(self, status: str, message: str, *, restart: RestartRecord | None = None,
               latest: int | None = None) -> TriggerEvent:
        return TriggerEvent({
            "status": status, "pipeline_id": self.pipeline_id, "lineage": self.lineage, "run_id": self.run_id,
            "attempt": restart.attempt if restart else None, "cause": restart.cause if restart else None,
            "delay": restart.delay_s if restart else None, "message": message, "latest_epoch": latest,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: supervise until the run stops, fails for good, or must be restarted."""
        try:
            store = await open_async_store(self.conn_id)
            event = await self._supervise(store)
        except ArroyoError as exc:
            event = self._event("error", f"epoch store error while supervising {self.pipeline_id!r}: {exc}")
        await hold_until(self.not_before, self.log, self.pipeline_id)
        yield event

    async def _supervise(self, store: AsyncEpochStore) -> TriggerEvent:
        self.log.info("Supervising pipeline %s run %s (lineage %s, restart strategy %s)", self.pipeline_id,
                      self.run_id, self.lineage, self.strategy)
        await self._adopt_newer_restart(store)
        outage_since: float | None = None
        while True:
            try:
                event = await self._look(store)
                outage_since = None
            except TransientStoreError as exc:  # the controller's rule: ride out a short outage
                outage_since = outage_since or time.monotonic()
                if time.monotonic() - outage_since > self.heartbeat_timeout:
                    raise
                self.log.warning("Pipeline %s: epoch store unreachable, will look again: %s", self.pipeline_id, exc)
                event = None
            if event is not None:
                return event
            await self.sleep_watching(self.poll_interval)

    async def _look(self, store: AsyncEpochStore) -> TriggerEvent | None:
        """One look: the final event, or None while the run is up (or starting in time)."""
        try:
            record: PipelineRecord | None = await store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            record = None
        if record is not None and not in_lineage(record, self.lineage):
            # whatever its state: while supervised, the lineage's own runs are always the current one
            return self._event("superseded", (
                f"pipeline {self.pipeline_id!r} is now run {record.run_id!r} ({record.state}), not of lineage "
                f"{self.lineage!r}: another submit took it over; this task no longer supervises it"))
        ours = record is not None and record.run_id == self.run_id
        if ours and record is not None and record.state is PipelineState.STOPPED:
            await store.end_supervision(self.pipeline_id, self.lineage)
            latest = await store.latest_completed_epoch(self.pipeline_id)
            return self._event("stopped", f"pipeline {self.pipeline_id!r} run {self.run_id!r} stopped",
                               latest=latest.epoch if latest else None)
        cause = await self._failure(store, record if ours else None)
        if cause is not None:
            return await self._decide(store, cause)
        return None

    async def _failure(self, store: AsyncEpochStore, record: PipelineRecord | None) -> str | None:
        """Why run ``run_id`` has failed, or None while it is up (or still starting in time).
        ``record``: the pipeline's record when its current run is ``run_id``, else None (not registered yet)."""
        if record is not None:
            if record.state is PipelineState.FAILED:
                return f"the driver of run {self.run_id} failed: {record.failure_cause or 'no cause reported'}"
            if record.state is PipelineState.RUNNING:
                self.start_deadline = None
            if record.heartbeat_at is not None and record.state in _HEARTBEATING:
                age = ((await store.db_now()) - record.heartbeat_at).total_seconds()
                if age > self.heartbeat_timeout:
                    return (f"the driver of run {self.run_id} has not heartbeated for {age:.0f}s (more than "
                            f"{self.heartbeat_timeout:g}s): it hangs or died without a word")
        if self.submit_process_exited():
            again = await store.get_pipeline(self.pipeline_id)  # it may have written its end just before exiting
            if again.run_id == self.run_id and again.state is PipelineState.STOPPED:
                return None
            tail = await asyncio.to_thread(log_tail, self.submit_log, 15, settle=2.0)  # its last lines written
            return await self._dead(store, (
                f"spark-submit of run {self.run_id} (pid {self.submit_pid}) exited while the run was "
                f"{again.state if again.run_id == self.run_id else 'not registered'}; see {self.submit_log}"
                + (f"; its last lines:\n{tail}" if tail else "")))
        if (ended := await self.cluster_app_ended()) is not None:
            again = await store.get_pipeline(self.pipeline_id)
            if not (again.run_id == self.run_id and again.state is PipelineState.STOPPED):
                return await self._dead(store, f"the cluster application of run {self.run_id} ended: {ended}")
        if self.start_deadline is not None and time.time() > self.start_deadline:
            return f"run {self.run_id} did not reach running in time (the submit's register_timeout)"
        return None

    async def _dead(self, store: AsyncEpochStore, cause: str) -> str:
        """The run's driver is gone (its spark-submit exited, its cluster application ended): declare the run
        failed and fail its in-flight epoch now, in one transaction (:meth:`~airflow_arroyo.store.EpochStore.fail_run`),
        instead of leaving it ``running`` until its heartbeat goes stale and the epoch until its timeout. The
        supervision still watches, so whoever waits for the run waits for its restart. Returns ``cause``."""
        failed = await store.fail_run(self.pipeline_id, self.run_id, f"supervisor: {cause}")
        if failed is not None:
            self.log.warning("Pipeline %s run %s: its driver is gone; recorded it failed", self.pipeline_id,
                             self.run_id)
        return cause

    async def _adopt_newer_restart(self, store: AsyncEpochStore) -> None:
        """Submitting restarts itself, this trigger moves on to each new run, but Airflow re-creates a trigger from
        the arguments it was deferred with (a triggerer restarted, the trigger moved to another one): then the
        lineage's newest restart of the current supervision, if newer than ``run_id``, is the run to watch (its
        spark-submit found by the pid file beside its log, on this host)."""
        if self._resubmission is None:  # restarts go through the task, which defers with the current run
            return
        restarts = await store.restarts(self.pipeline_id, self.lineage, 1)
        newest = restarts[0] if restarts else None
        if newest is None or newest.new_run_id is None or newest.new_run_id == self.run_id:
            return
        record = await store.get_pipeline(self.pipeline_id)
        if newest.supervised_since != record.supervised_since or newest.attempt <= restart_attempt(self.lineage,
                                                                                                   self.run_id):
            return
        self.run_id = newest.new_run_id
        process = _process_from_pid_file(log_path_of(self._resubmission.log_dir, self.pipeline_id, self.run_id))
        self._watch_submission(process.pid if process else None, process.host if process else None,
                               process.start_ticks if process else None,
                               str(log_path_of(self._resubmission.log_dir, self.pipeline_id, self.run_id)), False,
                               None, self.cluster_poll_interval)
        running = record.run_id == self.run_id and record.state in _HEARTBEATING
        self.start_deadline = None if running else time.time() + self.register_timeout
        self.log.info("Pipeline %s: supervising run %s, restart %s of lineage %s (submitted from the triggerer)",
                      self.pipeline_id, self.run_id, newest.attempt, self.lineage)

    async def _decide(self, store: AsyncEpochStore, cause: str) -> TriggerEvent | None:
        try:
            restart = await store.record_failure(self.pipeline_id, self.lineage, self.run_id, cause, self._decide_in_tx)
        except ConcurrencyConflict as exc:
            return self._event("superseded", str(exc))
        self.log.warning("Pipeline %s run %s failed (failure %s of lineage %s): %s; %s", self.pipeline_id,
                         self.run_id, restart.attempt, self.lineage, restart.cause, restart.decision)
        if restart.gave_up:
            if (await store.get_pipeline(self.pipeline_id)).stop_requested:
                return self._event("cancelled", f"pipeline {self.pipeline_id!r} run {self.run_id!r} failed while a "
                                                f"stop was requested: not restarted ({restart.cause})", restart=restart)
            return self._event("gave_up", f"pipeline {self.pipeline_id!r}: the restart strategy gave up "
                                          f"({restart.decision}); last cause: {restart.cause}", restart=restart)
        # The delay runs from when the failure was recorded (the database's clock): a triggerer that
        # picks this trigger up again mid-backoff waits only what is left of it.
        left = restart.delay_s - ((await store.db_now()) - restart.failed_at).total_seconds()
        if left > 0:
            self.log.info("Pipeline %s: restart %s in %.1fs", self.pipeline_id, restart.attempt, left)
            await asyncio.sleep(left)
        why_not = await store.claim_restart(self.pipeline_id, self.lineage, restart.attempt)
        if why_not is not None:  # e.g. a stop came during the backoff
            return self._event("cancelled", f"pipeline {self.pipeline_id!r}: restart {restart.attempt} not submitted: "
                                            f"{why_not}", restart=restart)
        if self._resubmission is not None:
            return await self._restart_here(store, restart)
        return self._event("restart", f"pipeline {self.pipeline_id!r}: restart {restart.attempt} after: "
                                      f"{restart.cause}", restart=restart)

    async def _restart_here(self, store: AsyncEpochStore, restart: RestartRecord) -> TriggerEvent | None:
        """Restart the lineage from here (what the operator's restart does, without a worker): end what is left
        of the failed run, record the restart (before submitting it: a triggerer that dies in between leaves a
        restart the re-created trigger watches, whose start deadline catches a submission that never happened),
        submit ``<lineage>.restart<n>`` restoring the latest completed epoch, and watch it. None: keep
        supervising; a submission that cannot start is the new run's failure, decided as any other."""
        assert self._resubmission is not None
        failed_run = self.run_id
        await store.call(end_failed_run, self.pipeline_id, failed_run, self.process, self.cluster_app, restart.cause,
                         self.log)
        latest = await store.latest_completed_epoch(self.pipeline_id)
        new_run = restart_run_id(self.lineage, restart.attempt)
        self.log.warning("Pipeline %s: restart %s of lineage %s after: %s; restoring %s as run %s (submitted from the "
                         "triggerer)", self.pipeline_id, restart.attempt, self.lineage, restart.cause,
                         f"epoch {latest.epoch}" if latest is not None else "no epoch (none completed: a start over)",
                         new_run)
        await store.record_restart(self.pipeline_id, self.lineage, restart.attempt, new_run,
                                   latest.epoch if latest is not None else None)
        self.run_id = new_run
        self.start_deadline = time.time() + self.register_timeout
        self._watch_submission(None, None, None, None, False, None, self.cluster_poll_interval)
        try:
            dsn = await asyncio.to_thread(_dsn, self.conn_id)
            process, log_path = await asyncio.to_thread(launch, self._resubmission, new_run, dsn)
        except Exception as exc:  # noqa: BLE001 - the new run's failure, with its cause
            return await self._decide(store, f"spark-submit of run {new_run} could not be started from the triggerer: "
                                             f"{type(exc).__name__}: {exc}")
        self._watch_submission(process.pid, process.host, process.start_ticks, str(log_path), False, None,
                               self.cluster_poll_interval)
        self.log.info("Pipeline %s run %s: spark-submit started (pid %s), log %s on %s", self.pipeline_id, new_run,
                      process.pid, log_path, process.host)
        return None

    def _decide_in_tx(self, failures: list[PastFailure], now: datetime, stop_requested: bool) -> RestartDecision:
        return decide_restart(self._strategy, failures, now, lineage=self.lineage, stop_requested=stop_requested)

    async def on_kill(self) -> None:
        """The user killed the deferred task: the supervision ends (the run itself is left as it is;
        stop it with the stop operator or ``airflow-arroyo stop``)."""
        store = await open_async_store(self.conn_id)
        await store.end_supervision(self.pipeline_id, self.lineage, SupervisionState.ENDED)


def _dsn(conn_id: str) -> str:
    from airflow_arroyo.hooks.arroyo import ArroyoHook

    return ArroyoHook(conn_id).get_dsn()


def _process_from_pid_file(log_path: Path) -> LocalProcess | None:
    """The spark-submit a ``<run>.pid`` file beside a driver log names (pid, start time, host), if readable."""
    try:
        fields = log_path.with_suffix(".pid").read_text().split()
    except OSError:
        return None
    if len(fields) < 3 or not fields[0].isdigit():
        return None
    return LocalProcess(int(fields[0]), fields[2], int(fields[1]) if fields[1].isdigit() else None)
