"""The checkpoint controller: a trigger that fires a pipeline's epochs from the triggerer.

While the pipeline runs, :class:`CheckpointTrigger` ticks: each tick is one call of
:meth:`~airflow_arroyo.store.EpochStore.trigger_tick`, which reads the facts and applies the pure
decision of :func:`~airflow_arroyo.core.epochs.decide_trigger` in one transaction under the pipeline's
row lock (start epoch n+1, expire a timed-out epoch, or wait). So every rule lives in the model and
the database, not here: one epoch in flight at most (a partial unique index makes a second one
impossible even for a second copy of this trigger in another triggerer), none while the cleanup
lock is held, the interval between starts and the minimum pause after an end, the timeout.

What this trigger adds is time and reporting: it sleeps until the next decision is worth making
(``min(recheck_at - now, poll)``, both instants from the database clock, so triggerers on different
hosts agree), or, while it waits for an epoch to end or the pipeline to run, until the database
announces a change (LISTEN/NOTIFY through the loop's shared listener); it logs each epoch's start
and end as they happen (trigger log), counts consecutive failures against the tolerance, and ends
with one event carrying a summary of the epochs it saw:

* ``status="success"`` when the pipeline stopped;
* ``status="failure"`` when the pipeline failed (with its cause), when more consecutive epochs
  failed or expired than tolerated, when the pipeline never registered, or when the epoch store
  failed permanently or stayed unreachable longer than the checkpoint timeout.

It keeps no state that matters outside the database: a triggerer restart (or a second copy) picks
up where the database says the pipeline is. It serializes exactly its constructor arguments and
builds its store client inside :meth:`CheckpointTrigger.run` from the connection id.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_arroyo import config
from airflow_arroyo.core.epochs import (
    CheckpointPolicy,
    EpochState,
    PipelineState,
    TriggerAction,
    due_after_start,
    validate_pipeline_id,
)
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConfigurationError,
    TransientStoreError,
    UnknownPipelineError,
)
from airflow_arroyo.core.supervision import in_lineage, restart_pending
from airflow_arroyo.core.units import bytes_human
from airflow_arroyo.metrics import EpochMetrics, slowest_alignment
from airflow_arroyo.store import AsyncEpochStore, EpochRecord, PipelineRecord, Subscription, TickResult
from airflow_arroyo.triggers.settle import hold_until

if TYPE_CHECKING:
    from airflow_arroyo.lineage import EpochLineage

__all__ = ["CheckpointTrigger", "format_bytes", "format_epoch_line"]

DEFAULT_CONN_ID = "arroyo_default"
DEFAULT_POLL = 5.0
OVERDUE_POLL_MIN = 0.02  # shortest look-again while the next epoch is overdue behind an in-flight one
# Another copy of this trigger (triggerer HA: the same ``triggered_by``) started the last epoch it saw
# since its previous tick: it follows, ticking this
# share of the interval (at most FOLLOWER_LAG_MAX seconds) after each epoch is due, so that the copy
# that leads finds the pipeline's row free and this one finds the epoch started, instead of both
# racing for the same row every interval. A follower that finds the epoch not started starts it
# (late by the lag, once) and leads from then on.
FOLLOWER_LAG = 0.2
FOLLOWER_LAG_MAX = 1.0
# A follower that heard the leading copy start the epoch it was going to tick for (the database announces
# every start; a follower listens to its pipeline's starts) skips that tick: the tick would decide nothing.
# It still ticks after this many skips in a row (to see the epochs end, for its log and summary), and
# whenever it heard no start, or heard the pipeline change, or its listener lost its connection since its
# last tick. 0: a follower ticks for every epoch.
FOLLOWER_SKIPS = 4
# Wait for the database's announcements (epoch ended, pipeline changed) rather than poll for them.
# Without a live listener (off here, or its connection lost) the trigger polls.
WAKE_ON_NOTIFY = True
# When the first of these triggers runs in a triggerer, freeze every object alive then (the modules Airflow
# imported) out of the cyclic collector's reach, as the dag processor does: otherwise full collections scan them
# all and stall the event loop, which makes epochs late (figures: benchmarks/results/trigger_load.md). Cycles among
# frozen objects would stay in memory; ``[arroyo] triggerer_freeze_gc = False`` leaves the collector alone.
_gc_frozen = False


def _freeze_gc_once() -> None:
    global _gc_frozen
    if _gc_frozen:
        return
    _gc_frozen = True
    try:
        wanted = config.get_bool("triggerer_freeze_gc")
    except Exception as exc:  # noqa: BLE001 - Airflow's config error; a performance setting never stops checkpoints
        logging.getLogger(__name__).warning("%s; freezing the garbage collector's old objects, the default", exc)
        wanted = True
    if wanted:
        gc.collect()  # once: what is garbage now is not frozen
        gc.freeze()


def _epoch_lineage(pipeline_id: str) -> EpochLineage | None:
    """The emitter of the pipeline's OpenLineage run events per epoch (docs/lineage.md); None without OpenLineage's
    client (the ``[openlineage]`` extra), whose events are then simply not sent."""
    try:
        from airflow_arroyo.lineage import EpochLineage
    except ImportError as exc:
        logging.getLogger(__name__).debug("pipeline %s: no OpenLineage events of epochs: %s", pipeline_id, exc)
        return None
    return EpochLineage(pipeline_id, kafka_namespace=config.get("lineage_kafka_namespace") or None)


def format_bytes(n: int | None) -> str:
    """A byte count for a log line (``1.5 MiB``; ``? B`` when unknown)."""
    return bytes_human(n, missing="? B")


def format_epoch_line(pipeline_id: str, entry: dict[str, Any]) -> str:
    """One human line for an epoch of a summary (used by the trigger log and the operator's task log)."""
    duration = entry.get("duration_s")
    took = f"{duration:.3f}s" if isinstance(duration, int | float) else "?s"
    line = (f"pipeline {pipeline_id} epoch {entry['epoch']} {entry['state']} in {took}: "
            f"{format_bytes(entry.get('bytes_new'))} new, {format_bytes(entry.get('bytes_total'))} total")
    if entry.get("failure_reason"):
        line += f" ({entry['failure_reason']})"
    return line


@dataclass
class _Summary:
    """Outcomes of the epochs this trigger saw end (newest ``limit`` listed, all counted)."""

    limit: int
    counts: dict[str, int] = field(default_factory=lambda: {"completed": 0, "failed": 0, "expired": 0})
    entries: collections.deque[dict[str, Any]] = field(default_factory=collections.deque)
    omitted: int = 0

    def add(self, rec: EpochRecord) -> dict[str, Any]:
        state = _outcome(rec)
        self.counts[state] = self.counts.get(state, 0) + 1
        entry = {
            "epoch": rec.epoch,
            "state": state,
            "triggered_at": rec.triggered_at.isoformat(),
            "duration_s": rec.duration_s,
            "bytes_new": rec.bytes_new,
            "bytes_total": rec.bytes_total,
            "failure_reason": rec.failure_reason,
        }
        self.entries.append(entry)
        while len(self.entries) > self.limit:
            self.entries.popleft()
            self.omitted += 1
        return entry

    def as_dict(self) -> dict[str, Any]:
        return {**self.counts, "epochs": list(self.entries), "omitted": self.omitted}


def _outcome(rec: EpochRecord) -> str:
    """How an epoch that ended ended, as the store recorded it (pruned since: the outcome it was pruned with)."""
    return (rec.outcome or rec.state).value


class CheckpointTrigger(BaseTrigger):
    """Fire checkpoint epochs of ``pipeline_id`` while it runs; end when it stops or fails.

    :param pipeline_id: the pipeline whose epochs to fire.
    :param conn_id: an ``arroyo`` or ``postgres`` connection to the epoch store.
    :param interval: the checkpoint interval in seconds: one epoch per interval, on a fixed-rate schedule
        (``airflow_arroyo.core.epochs.next_start_at``).
    :param timeout: seconds after which an epoch still in flight expires (default: ten intervals,
        at least 60 s); at least ``interval``.
    :param min_pause: seconds between the end of an epoch and the start of the next.
    :param tolerable_failures: consecutive failed or expired epochs tolerated; one more ends the
        trigger with a failure event.
    :param poll_interval: longest sleep between two ticks (default: the interval, at most 5 s);
        bounds how late an epoch's end is noticed and logged.
    :param triggered_by: recorded on every epoch this trigger starts (who fired it).
    :param pipeline_run_id: if given, only this run of the pipeline counts: a pipeline that
        stopped in an earlier run is waited for (it has not started yet), not reported as stopped.
    :param registration_timeout: seconds to wait for the pipeline (or ``pipeline_run_id``) to
        register before ending with a failure event; also how long after it is due (or submitted) a
        supervised restart may take to register before it is declared failed (its submitter may have died).
    :param max_summary_epochs: how many epochs the final event lists (the newest; all are counted).
    :param stop_after_epochs: ask the pipeline for a graceful stop so that its final epoch is the
        N-th completed epoch this controller saw: once N-1 epochs have completed or are in flight,
        no more are started and the stop's final epoch is the N-th. None: run until stopped.
    :param not_before: UNIX time before which the final event is not yielded (the deferring task's
        settle time, see :mod:`airflow_arroyo.triggers.settle`).
    """

    def __init__(
        self,
        pipeline_id: str,
        conn_id: str = DEFAULT_CONN_ID,
        interval: float = 30.0,
        timeout: float | None = None,
        min_pause: float = 0.0,
        tolerable_failures: int = 3,
        poll_interval: float | None = None,
        triggered_by: str = "airflow-trigger",
        pipeline_run_id: str | None = None,
        registration_timeout: float = 600.0,
        max_summary_epochs: int = 1000,
        stop_after_epochs: int | None = None,
        not_before: float | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        validate_pipeline_id(pipeline_id)
        # validate now: a bad configuration fails the task before it defers
        CheckpointPolicy(interval=interval, timeout=timeout, min_pause=min_pause,
                         tolerable_failures=tolerable_failures)
        if poll_interval is not None and not (isinstance(poll_interval, int | float) and poll_interval > 0):
            raise ConfigurationError(f"poll_interval must be a positive number of seconds, got {poll_interval!r}")
        if not isinstance(registration_timeout, int | float) or registration_timeout < 0:
            raise ConfigurationError(
                f"registration_timeout must be zero or a positive number of seconds, got {registration_timeout!r}"
            )
        if not isinstance(max_summary_epochs, int) or max_summary_epochs < 0:
            raise ConfigurationError(f"max_summary_epochs must be a whole number >= 0, got {max_summary_epochs!r}")
        self.pipeline_id = pipeline_id
        self.conn_id = conn_id
        self.interval = interval
        self.timeout = timeout
        self.min_pause = min_pause
        self.tolerable_failures = tolerable_failures
        self.poll_interval = poll_interval
        self.triggered_by = triggered_by
        self.pipeline_run_id = pipeline_run_id
        self.registration_timeout = registration_timeout
        if stop_after_epochs is not None and (
            isinstance(stop_after_epochs, bool) or not isinstance(stop_after_epochs, int) or stop_after_epochs < 1
        ):
            raise ConfigurationError(f"stop_after_epochs must be a whole number >= 1, got {stop_after_epochs!r}")
        self.max_summary_epochs = max_summary_epochs
        self.stop_after_epochs = stop_after_epochs
        self.not_before = not_before

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "pipeline_id": self.pipeline_id,
                "conn_id": self.conn_id,
                "interval": self.interval,
                "timeout": self.timeout,
                "min_pause": self.min_pause,
                "tolerable_failures": self.tolerable_failures,
                "poll_interval": self.poll_interval,
                "triggered_by": self.triggered_by,
                "pipeline_run_id": self.pipeline_run_id,
                "registration_timeout": self.registration_timeout,
                "max_summary_epochs": self.max_summary_epochs,
                "stop_after_epochs": self.stop_after_epochs,
                "not_before": self.not_before,
            },
        )

    @property
    def policy(self) -> CheckpointPolicy:
        """The policy the constructor arguments describe."""
        return CheckpointPolicy(interval=self.interval, timeout=self.timeout, min_pause=self.min_pause,
                                tolerable_failures=self.tolerable_failures)

    @property
    def effective_poll(self) -> float:
        """Seconds between ticks when nothing wakes the trigger earlier."""
        return float(self.poll_interval) if self.poll_interval is not None else min(DEFAULT_POLL, self.interval)

    def _metrics(self) -> EpochMetrics:
        """Airflow's Stats for this pipeline. A seam for tests."""
        return EpochMetrics(self.pipeline_id)

    async def _open_store(self) -> AsyncEpochStore:
        """The store client, built here (never serialized). A seam for tests."""
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return await ArroyoHook(self.conn_id).aget_store()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: fire epochs until the pipeline ends (or a failure limit is reached); one final event."""
        summary = _Summary(limit=self.max_summary_epochs)
        _freeze_gc_once()
        try:
            store = await self._open_store()
        except (ArroyoError, AirflowNotFoundException) as exc:
            yield self._event("failure", summary, reason="store_error",
                              message=f"cannot open the epoch store of connection {self.conn_id!r}: {exc}")
            return
        controller = _Controller(self, store, summary)
        event = await controller.run()
        await hold_until(self.not_before, self.log, self.pipeline_id)
        yield event

    def _event(self, status: str, summary: _Summary, *, reason: str, message: str,
               pipeline: PipelineRecord | None = None, cause: str | None = None) -> TriggerEvent:
        return TriggerEvent({
            "status": status,
            "reason": reason,
            "message": message,
            "cause": cause,
            "pipeline_id": self.pipeline_id,
            "pipeline_state": pipeline.state.value if pipeline is not None else None,
            "pipeline_run_id": pipeline.run_id if pipeline is not None else self.pipeline_run_id,
            "summary": summary.as_dict(),
        })


class _Controller:
    """The loop of one running trigger. Its state is a cache of the database, rebuilt after a restart."""

    clock = staticmethod(time.monotonic)  # for how long the store has been unreachable (no DB to ask)

    def __init__(self, trigger: CheckpointTrigger, store: AsyncEpochStore, summary: _Summary) -> None:
        self.t = trigger
        self.store = store
        self.summary = summary
        self.policy = trigger.policy
        self.poll = trigger.effective_poll
        self.log = trigger.log
        self.pipeline_id = trigger.pipeline_id
        self.watching: set[int] = set()  # epochs seen in flight, not yet seen ended
        self.run_confirmed = trigger.pipeline_run_id is None
        self.registration_deadline: datetime | None = None
        self.outage_since: float | None = None
        self.cleanup_wait: str | None = None  # the cleanup wait already logged (reason names the holder)
        self.idle_state: str | None = None  # last logged "pipeline not running" state
        self.not_alive = False  # logged that the driver's heartbeat is stale
        self.overdue_polls = 0  # consecutive ticks that found the next epoch overdue behind an in-flight one
        self.follower = False  # another copy of this trigger started the last epoch seen (FOLLOWER_LAG)
        self.may_skip = False  # the current wait is a follower's, for the due instant ``follow_due``
        self.follow_due = 0.0  # (time.monotonic()) when a follower's wait ends: a due instant plus its lag
        self.skips = 0  # ticks skipped in a row (FOLLOWER_SKIPS)
        self.changes_seen = 0  # the subscription's count of changes before the last tick
        self.known = -1  # the highest epoch number seen (in a tick, or heard starting)
        self.ticked = False  # an epoch in flight at the first tick was started before this trigger ran
        self.interval_recorded = False  # the interval is written once the run to control is known
        self.stop_requested = False  # by stop_after_epochs
        self.metrics = trigger._metrics()
        self.sub: Subscription | None = None  # wake-ups from the database (None: poll)
        self.mark = 0  # the subscription's mark taken before the last tick
        self.wake = False  # may the next wait end early on an announcement?
        self.lineage = _epoch_lineage(self.pipeline_id)  # OpenLineage events of completed epochs (or None)

    async def run(self) -> TriggerEvent:
        self.log.info(
            "checkpoint controller for pipeline %s: interval %ss, timeout %ss, min pause %ss, "
            "tolerating %s consecutive failures (poll %ss)",
            self.pipeline_id, self.policy.interval, self.policy.effective_timeout, self.policy.min_pause,
            self.policy.tolerable_failures, self.poll,
        )
        if WAKE_ON_NOTIFY:
            self.sub = await self.store.subscribe(self.pipeline_id)
        try:
            return await self._loop()
        finally:
            if self.sub is not None:
                self.sub.close()

    async def _loop(self) -> TriggerEvent:
        while True:
            self.wake = False
            try:
                event, delay = await self._step()
            except TransientStoreError as exc:
                event, delay = self._outage(exc), self.poll
            except ArroyoError as exc:
                return self.t._event("failure", self.summary, reason="store_error",
                                     message=f"epoch store error for pipeline {self.pipeline_id}: {exc}")
            if event is not None:
                return event
            if self.wake and self.listening:
                await self.sub.wait(self.mark, delay)  # type: ignore[union-attr]
            else:
                await asyncio.sleep(delay)

    @property
    def listening(self) -> bool:
        return self.sub is not None and self.sub.live

    def _outage(self, exc: TransientStoreError) -> TriggerEvent | None:
        now = self.clock()
        if self.outage_since is None:
            self.outage_since = now
        down = now - self.outage_since
        if down > self.policy.effective_timeout:
            return self.t._event(
                "failure", self.summary, reason="store_error",
                message=f"epoch store of pipeline {self.pipeline_id} unreachable for {down:.0f}s, longer than the "
                        f"checkpoint timeout ({self.policy.effective_timeout:g}s): {exc}")
        self.log.warning("pipeline %s: epoch store unreachable for %.0fs, will retry: %s", self.pipeline_id, down, exc)
        return None

    async def _step(self) -> tuple[TriggerEvent | None, float]:
        """One tick: returns the final event, or how long to sleep before the next tick."""
        if not self.run_confirmed:
            waited = await self._wait_for_run()
            if waited is not None:
                return waited
        if self._skip():
            return None, self._skipped_delay()
        self._mark()
        if not self.interval_recorded:  # before the first tick: no time taken between its ticks
            try:
                await self._record_interval()
            except UnknownPipelineError:
                return await self._not_registered(f"pipeline {self.pipeline_id} is not registered yet")
        if self.t.stop_after_epochs == 1 and not self.stop_requested:  # before the first tick starts one
            try:
                await self._stop_after_epochs((await self.store.get_pipeline(self.pipeline_id)).state)
            except UnknownPipelineError:
                return await self._not_registered(f"pipeline {self.pipeline_id} is not registered yet")
        try:
            tick = await self.store.trigger_tick(self.pipeline_id, self.policy, triggered_by=self.t.triggered_by,
                                                 watch=sorted(self.watching))
        except UnknownPipelineError:
            return await self._not_registered(f"pipeline {self.pipeline_id} is not registered yet")
        self.outage_since = None
        self.registration_deadline = None
        new_failure = await self._observe(tick)
        if self.lineage is not None:
            await self.lineage.look(self.store, self.summary.counts["completed"])
        decision = tick.decision
        await self._stop_after_epochs(tick.pipeline_state)

        if decision.action is TriggerAction.PIPELINE_ENDED:
            return await self._pipeline_ended()

        if new_failure and tick.consecutive_failures > self.policy.tolerable_failures:
            return self.t._event(
                "failure", self.summary, reason="too_many_failures",
                message=f"pipeline {self.pipeline_id}: {tick.consecutive_failures} consecutive epochs failed or "
                        "expired, "
                        f"more than the {self.policy.tolerable_failures} tolerated; see the failure reasons "
                        "in the summary and the pipeline's driver log"), 0.0

        await self._log_waits(tick)
        return None, self._delay(tick)

    async def _pipeline_ended(self) -> tuple[TriggerEvent | None, float]:
        """The run ended: wait for ours, or for its restart while a supervisor restarts it; else the end event."""
        pipe = await self.store.get_pipeline(self.pipeline_id)
        if not in_lineage(pipe, self.t.pipeline_run_id):
            self.run_confirmed = False  # a new run registered meanwhile and ended? wait for ours
            return None, self.poll
        if restart_pending(pipe):  # supervised: the failed run comes back as a restart of it
            # unless its submitter died before the restart registered: past the registration bound the
            # restart is declared failed, and its strategy restarts again or gives up (which ends this wait)
            overdue = await self.store.expire_restart(self.pipeline_id, float(self.t.registration_timeout))
            if overdue is not None:
                self.log.warning("pipeline %s: %s; %s", self.pipeline_id, overdue.cause, overdue.decision)
                pipe = await self.store.get_pipeline(self.pipeline_id)
        if restart_pending(pipe):
            if self.idle_state != "restarting":
                self.idle_state = "restarting"
                self.log.info("pipeline %s: run %s failed and its supervisor restarts it; no epoch until the "
                              "restart runs", self.pipeline_id, pipe.run_id)
            return None, self.poll
        if self.lineage is not None:  # the run ended: its newest epoch is settled too
            await self.lineage.look(self.store, self.summary.counts["completed"], final=True)
        return self._ended(pipe), 0.0

    def _mark(self) -> None:
        """Right before a tick: what the subscription heard so far (its announcements from now on end the
        next wait at once, and tell whether the next tick may be skipped)."""
        self.skips = 0
        self.may_skip = False  # until this tick's _delay says the wait is a follower's for a due instant
        if self.sub is not None:
            self.mark = self.sub.mark()
            self.changes_seen = self.sub.changes()
            self._heard(self.sub.starts_after(self.known))

    def _heard(self, started: list[int]) -> None:
        """Epochs heard starting (a follower's): watched, so that a tick reads their ends."""
        if started:
            self.watching.update(started)
            self.known = started[-1]

    def _skip(self) -> bool:
        """A follower skips its tick when it heard an epoch start from the instant it was due (the leading
        copy started it), and nothing else happened since its last tick (FOLLOWER_SKIPS). What it heard
        starting, it watches: its next tick sees those epochs end."""
        if not (self.may_skip and self.listening and self.skips < FOLLOWER_SKIPS and self.outage_since is None):
            return False
        assert self.sub is not None
        if self.sub.changes() != self.changes_seen:
            return False
        # only a start heard from about the due instant on (a lag's margin for mapping database time to ours)
        # is the leader's: one heard earlier was a manual checkpoint, and a dead leader would go unnoticed
        if not self.sub.starts_after(self.known, heard_since=self.follow_due - 2 * self._lag):
            return False
        self.skips += 1
        self._heard(self.sub.starts_after(self.known))
        return True

    @property
    def _lag(self) -> float:
        """How much later than the schedule a follower ticks (FOLLOWER_LAG)."""
        return min(FOLLOWER_LAG * self.policy.interval, FOLLOWER_LAG_MAX)

    def _skipped_delay(self) -> float:
        """After a skipped tick: until the schedule's next point, plus the follower's lag (about an interval:
        a follower skips only where its waits are not cut short by ``poll``)."""
        now = time.monotonic()
        interval = self.policy.interval
        due = self.follow_due + interval
        while due <= now:
            due += interval
        self.follow_due = due
        return due - now

    async def _record_interval(self) -> None:
        """Write the interval this controller fires at on the run it controls (UI, overdue warning)."""
        pipe = await self.store.get_pipeline(self.pipeline_id)
        if pipe.state.terminal:
            return  # an ended run: the next one (or the end event) decides
        if pipe.run_id is not None:
            await self.store.record_checkpoint_interval(self.pipeline_id, pipe.run_id, float(self.policy.interval))
        self.interval_recorded = True

    async def _stop_after_epochs(self, state: PipelineState) -> None:
        """With ``stop_after_epochs`` N: once N-1 epochs completed or are in flight, request a graceful
        stop; the driver's final epoch is then the N-th (it waits for an in-flight one to end first)."""
        limit = self.t.stop_after_epochs
        if limit is None or self.stop_requested or state is not PipelineState.RUNNING:
            return
        counted = self.summary.counts["completed"] + len(self.watching)
        if counted >= limit - 1:
            self.stop_requested = True
            if (await self.store.get_pipeline(self.pipeline_id)).stop_requested:
                return  # someone asked already: never turn an immediate stop into a graceful one
            await self.store.request_stop(self.pipeline_id, "graceful")
            self.log.info("pipeline %s: %s epochs completed or in flight; requested a graceful stop, whose final "
                          "epoch makes %s (stop_after_epochs)", self.pipeline_id, counted, limit)

    async def _wait_for_run(self) -> tuple[TriggerEvent | None, float] | None:
        try:
            pipe = await self.store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            return await self._not_registered(f"pipeline {self.pipeline_id} is not registered yet")
        if in_lineage(pipe, self.t.pipeline_run_id):
            self.run_confirmed = True
            self.registration_deadline = None
            return None
        return await self._not_registered(
            f"pipeline {self.pipeline_id} run {self.t.pipeline_run_id} has not registered yet "
            + ("(no run has run yet)" if pipe.run_id is None else f"(the current run is {pipe.run_id}, {pipe.state})"))

    async def _not_registered(self, what: str) -> tuple[TriggerEvent | None, float]:
        now = await self.store.db_now()
        if self.registration_deadline is None:
            self.registration_deadline = now + timedelta(seconds=self.t.registration_timeout)
            self.log.info("%s; waiting up to %ss", what, self.t.registration_timeout)
        if now >= self.registration_deadline:
            return self.t._event(
                "failure", self.summary, reason="not_registered",
                message=f"{what} after {self.t.registration_timeout}s; check that the pipeline's driver "
                        "started and points at the same epoch store"), 0.0
        return None, min(self.poll, (self.registration_deadline - now).total_seconds())

    async def _observe(self, tick: TickResult) -> bool:
        """Log epochs that started or ended since the last tick; True if one ended unsuccessfully."""
        decision = tick.decision
        new_failure = False
        if tick.expired is not None:
            self.watching.discard(tick.expired.epoch)
            self._record(tick.expired)
            await self._measure(tick.expired, tick)
            new_failure = True
        current = decision.epoch if decision.action is TriggerAction.WAIT_IN_FLIGHT else None
        ended = {rec.epoch: rec for rec in tick.ended}  # the watched epochs that ended, read in the tick
        for epoch in sorted(n for n in self.watching if n != current):
            rec = ended.get(epoch) or await self.store.get_epoch(self.pipeline_id, epoch)
            if rec.state is EpochState.TRIGGERED:  # cannot be: another epoch is in flight or none is
                continue
            self.watching.discard(epoch)
            new_failure |= self._record(rec)
            await self._measure(rec, tick)
        if current is not None and current not in self.watching:
            self.watching.add(current)
            seen = tick.report.in_flight if tick.report is not None else None
            if seen is not None and seen.epoch == current:
                rec = seen
            else:
                rec = await self.store.get_epoch(self.pipeline_id, current)
            # started since our last tick by another copy of this trigger (not a restart, a manual
            # checkpoint or the driver's final epoch): follow it
            self.follower = self.ticked and not rec.is_final and rec.triggered_by == self.t.triggered_by
            if rec.is_final:
                origin = "the final epoch of a graceful stop, taken by the pipeline's driver"
            elif self.follower:
                origin = "started by another copy of this controller (triggerer HA); following it"
            elif rec.triggered_by == self.t.triggered_by:
                origin = "started by this controller before the triggerer restarted"
            else:
                origin = f"started by {rec.triggered_by or 'another controller'}"
            self.log.info("pipeline %s epoch %s is in flight (%s); watching it", self.pipeline_id, current, origin)
        if current is None and tick.started is None:
            await self._unseen(tick)
        self.ticked = True
        self.known = max(self.known, tick.last_epoch or -1, *self.watching)
        if tick.started is not None:
            self.follower = False
            rec = tick.started
            self.metrics.epoch_started(rec, self.policy.interval)
            self.watching.add(rec.epoch)
            self.log.info("pipeline %s epoch %s started at %s (times out at %s)", self.pipeline_id, rec.epoch,
                          rec.triggered_at.isoformat(), rec.timeout_at.isoformat())
        if self.sub is not None:  # a follower hears the leading copy's starts, to skip ticks (FOLLOWER_SKIPS)
            self.sub.follow_starts(self.follower and FOLLOWER_SKIPS > 0)
        return new_failure

    async def _unseen(self, tick: TickResult) -> None:
        """An epoch that started and ended between two of our ticks (none in flight now): if another copy
        of this trigger started it (it won the race for the epoch we woke for), follow. Watched from now
        on: the next tick reads its end for the log and the summary."""
        last = tick.last_epoch
        if not self.ticked or not last or last <= self.known or last in self.watching:  # 0: no epoch yet
            return
        if tick.expired is not None and tick.expired.epoch == last:  # recorded already (by _observe)
            return
        if not self.follower:  # a follower already knows who leads: no read per tick
            rec = await self.store.get_epoch(self.pipeline_id, last)
            self.follower = not rec.is_final and rec.triggered_by == self.t.triggered_by
        self.watching.add(last)

    async def _measure(self, rec: EpochRecord, tick: TickResult) -> None:
        """Stats of an epoch that ended (the metrics module lists them); never fails the controller.
        Their inputs come with the tick when its batch read them (``tick.report``), else from the store."""
        outcome = _outcome(rec)
        report = tick.report
        if report is not None:
            alignment, heartbeat = report.alignment_ms.get(rec.epoch), report.heartbeat_at
        else:
            try:
                completed = outcome == EpochState.COMPLETED.value
                acks = await self.store.acks(self.pipeline_id, rec.epoch) if completed else []
                alignment = slowest_alignment(acks)
                heartbeat = (await self.store.get_pipeline(self.pipeline_id)).heartbeat_at
            except ArroyoError as exc:
                self.log.debug("pipeline %s: no metrics for epoch %s: %s", self.pipeline_id, rec.epoch, exc)
                alignment, heartbeat = None, None
        self.metrics.epoch_ended(rec, outcome, alignment if outcome == EpochState.COMPLETED.value else None,
                                 heartbeat, tick.now)

    def _record(self, rec: EpochRecord) -> bool:
        entry = self.summary.add(rec)
        if entry["state"] == EpochState.COMPLETED.value:
            self.log.info("%s", format_epoch_line(self.pipeline_id, entry))
            return False
        self.log.warning("%s", format_epoch_line(self.pipeline_id, entry))
        return True

    def _ended(self, pipe: PipelineRecord) -> TriggerEvent:
        s = self.summary.counts
        figures = f"{s['completed']} epochs completed, {s['failed']} failed, {s['expired']} expired"
        if pipe.state is PipelineState.FAILED:
            self.metrics.pipeline_failed()
            self.log.error("pipeline %s failed: %s (%s)", self.pipeline_id, pipe.failure_cause, figures)
            return self.t._event("failure", self.summary, reason="pipeline_failed", pipeline=pipe,
                                 cause=pipe.failure_cause,
                                 message=f"pipeline {self.pipeline_id} failed: "
                                         f"{pipe.failure_cause or 'no cause reported'}")
        return self.t._event("success", self.summary, reason="pipeline_stopped", pipeline=pipe,
                             message=f"pipeline {self.pipeline_id} stopped; {figures}")

    async def _log_waits(self, tick: TickResult) -> None:
        """Say once per wait why no epoch starts (cleanup lock held, pipeline not running or not alive)."""
        decision = tick.decision
        if decision.action is TriggerAction.PIPELINE_NOT_ALIVE:
            if not self.not_alive:
                self.log.warning("pipeline %s: %s", self.pipeline_id, decision.reason)
                self.not_alive = True
        elif self.not_alive:
            self.log.info("pipeline %s: the driver heartbeats again; checkpoints resume", self.pipeline_id)
            self.not_alive = False
        if decision.action is TriggerAction.WAIT_CLEANUP:
            if decision.reason != self.cleanup_wait:  # a new wait (or another holder took over)
                self.cleanup_wait = decision.reason
                lock = await self.store.cleanup_lock(self.pipeline_id)
                if lock is not None:
                    self.log.info("pipeline %s: waiting for cleanup run %s held by %s (lease until %s)",
                                  self.pipeline_id, lock.cleanup_run, lock.holder, lock.expires_at.isoformat())
        elif self.cleanup_wait is not None:
            self.log.info("pipeline %s: cleanup lock released; checkpoints resume", self.pipeline_id)
            self.cleanup_wait = None
        if decision.action is TriggerAction.PIPELINE_NOT_RUNNING:
            if decision.reason != self.idle_state:
                if tick.pipeline_state is PipelineState.RUNNING:  # running, but asked to stop
                    self.log.info("pipeline %s: a stop was requested; no new checkpoint while it stops",
                                  self.pipeline_id)
                else:
                    self.log.info("pipeline %s: %s; no checkpoint until it runs", self.pipeline_id, decision.reason)
                self.idle_state = decision.reason
        else:
            self.idle_state = None

    def _delay(self, tick: TickResult) -> float:
        """How long to sleep before the next tick: until the decision is worth making again.

        After a start: until the schedule's next point (``epochs.due_after_start``: the next epoch is due
        then). While waiting for the schedule or a cleanup lease: until ``recheck_at``. While an epoch is in
        flight: until the next one is due; once it is overdue, until the database announces the epoch's end (sets
        ``self.wake``), or without a listener in short polls that double (``interval / 50`` at
        first, at least 20 ms, then up to ``poll``), so that a late acknowledgement delays the next
        epoch by about as much again at most, not by a whole poll interval. While the pipeline does
        not run: until it changes. A follower (another copy of this trigger started the last epoch
        it saw) waits ``FOLLOWER_LAG`` of the interval longer for the schedule. Never past ``poll``
        (but a follower's skipped ticks, ``FOLLOWER_SKIPS``, each wait one more interval).

        Database instants become local timers through ``tick.observed_at`` (when the database read
        ``now``), so the time the tick took is not slept again.
        """
        decision = tick.decision
        delay = self.poll
        overdue = False
        if tick.started is not None:
            delay = min(delay, self._until(tick, due_after_start(self.pipeline_id, tick.started.triggered_at,
                                                                 self.policy)))
        elif decision.recheck_at is not None:
            delay = min(delay, self._until(tick, decision.recheck_at))
        if decision.action is TriggerAction.WAIT_IN_FLIGHT and decision.recheck_at is not None:
            # The in-flight epoch started one timeout before it times out (read from the database,
            # not remembered: right after a restart too).
            started = decision.recheck_at - timedelta(seconds=self.policy.effective_timeout)
            due = self._until(tick, due_after_start(self.pipeline_id, started, self.policy))
            if due > 0:
                delay = min(delay, due)
            elif self.listening:
                self.wake = True
            else:
                overdue = True
                base = max(OVERDUE_POLL_MIN, self.policy.interval / 50)
                delay = min(delay, base * 2 ** min(self.overdue_polls, 30))
        if decision.action is TriggerAction.PIPELINE_NOT_RUNNING:
            self.wake = True
        self.overdue_polls = self.overdue_polls + 1 if overdue else 0
        self.may_skip = False
        if self.follower and decision.action in (TriggerAction.WAIT_SCHEDULE, TriggerAction.WAIT_IN_FLIGHT) \
                and not self.wake and not overdue:
            # a wait that reaches the due instant before poll cuts it short (a cut one is poll exactly) ends up
            # to the lag after it: the next tick may be skipped
            self.may_skip = delay < self.poll
            delay = min(delay + self._lag, self.poll)
            self.follow_due = time.monotonic() + delay
        return max(delay, 0.0)

    @staticmethod
    def _until(tick: TickResult, at: datetime) -> float:
        """Seconds from now until the database instant ``at``."""
        seconds = (at - tick.now).total_seconds()
        if tick.observed_at is not None:
            seconds -= time.monotonic() - tick.observed_at
        return seconds
