"""``PipelineStateTrigger``: wait, in the triggerer, until a pipeline reaches a state or an epoch.

It backs the deferrable :class:`~airflow_arroyo.sensors.pipeline.PipelineSensor`, the submit
operator (wait until the submitted run is ``running``) and the stop operator (wait until
``stopped``). It polls the epoch store, asks the pure :func:`evaluate_wait` what the facts mean and
yields exactly one event::

    {"status": "success" | "failed" | "unreachable" | "timeout" | "error",
     "pipeline_id", "run_id", "state", "latest_epoch", "message", "cause",
     "spark_ui_url", "spark_app_id"}

* ``failed``: the pipeline failed; ``cause`` is what its driver reported. Reported at the next poll.
* ``unreachable``: the pipeline ended without reaching the target (e.g. it stopped before epoch N
  completed), or its driver stopped heartbeating, or the local ``spark-submit`` process exited
  before the run registered (the message then carries the tail of its log).
* ``timeout``: ``deadline`` (UNIX seconds) passed first.

When the submit operator defers to it, it also knows the detached ``spark-submit`` process
(``submit_pid``/``submit_host``/``submit_start_ticks``) and sets ``stop_on_kill``: if a user kills the
deferred task (mark failed/success, clear), :meth:`PipelineStateTrigger.on_kill` asks the pipeline to
stop immediately and, when the triggerer runs on the host that started ``spark-submit``, kills its
process group. A cluster-mode run (``cluster_application``) is instead watched and killed through its
cluster manager (:class:`~airflow_arroyo.submit.deploy.ClusterApplication`).

Usage (inside an operator)::

    self.defer(
        trigger=PipelineStateTrigger(pipeline_id="orders", state="running", run_id=run_id),
        method_name="execute_complete",
    )
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_arroyo.core.epochs import PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.core.supervision import in_lineage, restart_pending
from airflow_arroyo.store import AsyncEpochStore, EpochStore, PipelineRecord
from airflow_arroyo.submit.deploy import ClusterApplication
from airflow_arroyo.triggers.settle import hold_until

__all__ = [
    "WAITABLE_STATES",
    "WatchesSubmission",
    "PipelineStateTrigger",
    "WaitVerdict",
    "Verdict",
    "driver_error",
    "evaluate_wait",
    "log_tail",
    "normalize_target",
    "stop_run",
]

#: Pipeline states a DAG can wait for.
WAITABLE_STATES = (PipelineState.RUNNING, PipelineState.STOPPED, PipelineState.FAILED)


class Verdict(enum.StrEnum):
    """The outcome of one look at a pipeline."""
    WAIT = "wait"
    SUCCESS = "success"
    FAILED = "failed"  # the pipeline failed: fail at once with its cause
    UNREACHABLE = "unreachable"  # it ended (or vanished) without reaching the target


@dataclass(frozen=True)
class WaitVerdict:
    """A verdict with its message (and the failure cause)."""
    verdict: Verdict
    message: str = ""
    cause: str | None = None


def normalize_target(state: str | PipelineState | None,
                     epoch: int | str | None) -> tuple[PipelineState | None, int | None]:
    """Validate what to wait for: exactly one of a state (running, stopped, failed) or an epoch >= 1.

    Templated values arrive as strings (``"{{ params.epochs }}"``), hence the conversions.
    """
    if state in ("", None):
        state = None
    if epoch in ("", None):
        epoch = None
    if (state is None) == (epoch is None):
        raise ConfigurationError(
            "wait for exactly one thing: a pipeline state (state='running', 'stopped' or 'failed') "
            f"or an epoch number (epoch=3); got state={state!r}, epoch={epoch!r}"
        )
    if state is not None:
        try:
            target = PipelineState(str(state).strip().lower())
        except ValueError:
            target = None
        if target not in WAITABLE_STATES:
            raise ConfigurationError(
                f"cannot wait for pipeline state {state!r}: use one of "
                f"{', '.join(s.value for s in WAITABLE_STATES)} (or epoch=N to wait for a checkpoint)"
            )
        return target, None
    try:
        number = int(str(epoch).strip())
    except ValueError:
        number = 0
    if number < 1 or isinstance(epoch, bool):
        raise ConfigurationError(f"epoch must be a whole number >= 1 (the epoch to wait for), got {epoch!r}")
    return None, number


def evaluate_wait(
    pipeline: PipelineRecord | None,
    *,
    state: PipelineState | None = None,
    epoch: int | None = None,
    run_id: str | None = None,
    latest_completed: int | None = None,
    heartbeat_age: float | None = None,
    heartbeat_timeout: float | None = None,
) -> WaitVerdict:
    """What the facts say about a wait. Pure.

    * ``pipeline``: the pipeline's record, or None if it is not registered (yet).
    * ``run_id``: only this run (or a supervisor's restart of it) counts; until it registers (another
      run's record) we wait. A supervised run that failed or went silent is waited for while its
      supervisor restarts it (:func:`~airflow_arroyo.core.supervision.restart_pending`).
    * ``epoch``: wait until an epoch numbered ``epoch`` **or later** has completed (a checkpoint at
      least that recent exists; an expired epoch N followed by a completed N+1 satisfies it).
    * ``heartbeat_age``/``heartbeat_timeout``: a live (registered/running/stopping) pipeline whose
      driver has not heartbeated for longer than the timeout is presumed dead.
    """
    if pipeline is None:
        return WaitVerdict(Verdict.WAIT, "not registered yet")
    pid = pipeline.pipeline_id
    if not in_lineage(pipeline, run_id):
        current_run = "no run has run yet" if pipeline.run_id is None else f"current run {pipeline.run_id!r}"
        return WaitVerdict(Verdict.WAIT, f"run {run_id!r} not registered yet ({current_run})")
    current = pipeline.state
    if epoch is not None and latest_completed is not None and latest_completed >= epoch:
        return WaitVerdict(Verdict.SUCCESS, f"epoch {latest_completed} of {pid!r} is completed (waited for {epoch})")
    if current is PipelineState.FAILED:
        if state is PipelineState.FAILED:
            return WaitVerdict(Verdict.SUCCESS, f"pipeline {pid!r} failed", cause=pipeline.failure_cause)
        if restart_pending(pipeline):
            return WaitVerdict(Verdict.WAIT, f"run {pipeline.run_id!r} of {pid!r} failed and its supervisor restarts "
                                             f"it ({pipeline.failure_cause or 'no cause reported'})")
        return WaitVerdict(Verdict.FAILED, f"pipeline {pid!r} failed: {pipeline.failure_cause or 'no cause reported'}",
                           cause=pipeline.failure_cause)
    if state is PipelineState.RUNNING and current in (PipelineState.RUNNING, PipelineState.STOPPING):
        return WaitVerdict(Verdict.SUCCESS, f"pipeline {pid!r} is {current}")
    if state is PipelineState.STOPPED and current is PipelineState.STOPPED:
        return WaitVerdict(Verdict.SUCCESS, f"pipeline {pid!r} is stopped")
    if current is PipelineState.STOPPED:
        wanted = f"epoch {epoch}" if epoch is not None else f"state {state}"
        done = f" (latest completed epoch: {latest_completed})" if latest_completed is not None else ""
        return WaitVerdict(Verdict.UNREACHABLE,
                           f"pipeline {pid!r} stopped before it reached {wanted}{done}")
    if (heartbeat_timeout is not None and heartbeat_age is not None and heartbeat_age > heartbeat_timeout
            and not restart_pending(pipeline)):
        return WaitVerdict(
            Verdict.UNREACHABLE,
            f"pipeline {pid!r} is {current} but its driver has not heartbeated for {heartbeat_age:.0f}s "
            f"(> {heartbeat_timeout:g}s): it probably died; check the Spark driver's log",
        )
    return WaitVerdict(Verdict.WAIT, f"pipeline {pid!r} is {current}")


# --------------------------------------------------------------------------- the local spark-submit process


def driver_error(log_text: str) -> str | None:
    """The runtime driver's own error in (the tail of) its log: the last line it printed as ``error: ...``
    before exiting (``airflow_arroyo.runtime.driver.main``), without the prefix; None when there is none."""
    errors = [line[len("error: "):].strip() for line in log_text.splitlines() if line.startswith("error: ")]
    return errors[-1] if errors else None


def log_tail(path: str | None, lines: int = 30, *, settle: float = 0.0) -> str:
    """The last ``lines`` lines of a log file ('' if unreadable); when the file has fewer (it was just rotated:
    ``airflow_arroyo.operators.driver_log``), the rotated ``<path>.1`` supplies the lines before them. ``settle``:
    after spark-submit exited, wait up to that many seconds for the log's writer to write its last lines."""
    if not path:
        return ""
    if settle > 0:
        _wait_for_writer(f"{path}.writer", settle)
    out: list[str] = []
    for part in (path, f"{path}.1"):
        try:
            with open(part, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode("utf-8", errors="replace")
        except OSError:
            break
        out = text.splitlines()[-(lines - len(out)):] + out
        if len(out) >= lines:
            break
    return "\n".join(out[-lines:])


def _wait_for_writer(lock: str, timeout: float) -> None:
    """Wait until the driver log's writer (which holds ``lock`` while it runs) ended, at most ``timeout`` s."""
    import fcntl

    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no writer (a log written directly)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return  # something else still holds spark-submit's output: read what is there
                time.sleep(0.02)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- the trigger


async def open_async_store(conn_id: str) -> AsyncEpochStore:
    """The epoch store behind an Airflow connection (shared per DSN within the triggerer)."""
    from airflow_arroyo.hooks.arroyo import ArroyoHook

    return await ArroyoHook(conn_id).aget_store()


class WatchesSubmission:
    """What a trigger knows of the run the submit operator started, and the two checks on it that do not
    ask the epoch store: whether the local ``spark-submit`` exited, and whether the cluster manager says
    the application ended. Shared by :class:`PipelineStateTrigger` and
    :class:`~airflow_arroyo.triggers.supervise.PipelineSupervisorTrigger` (their constructors take the
    same ``submit_*`` / ``cluster_*`` arguments, serialized flat)."""

    submit_pid: int | None
    submit_host: str | None
    submit_start_ticks: int | None
    submit_log: str | None
    submit_exits: bool
    cluster_application: dict[str, Any] | None
    cluster_poll_interval: float

    def _watch_submission(self, submit_pid: int | None, submit_host: str | None, submit_start_ticks: int | None,
                          submit_log: str | None, submit_exits: bool, cluster_application: dict[str, Any] | None,
                          cluster_poll_interval: float) -> None:
        self.submit_pid = submit_pid
        self.submit_host = submit_host
        self.submit_start_ticks = submit_start_ticks
        self.submit_log = submit_log
        self.submit_exits = submit_exits
        self.cluster_application = dict(cluster_application) if cluster_application else None
        self.cluster_poll_interval = float(cluster_poll_interval)
        self._cluster_checked_at = 0.0

    def _submission_kwargs(self) -> dict[str, Any]:
        """The constructor arguments of what is watched (for ``serialize``)."""
        return {"submit_pid": self.submit_pid, "submit_host": self.submit_host,
                "submit_start_ticks": self.submit_start_ticks, "submit_log": self.submit_log,
                "submit_exits": self.submit_exits, "cluster_application": self.cluster_application,
                "cluster_poll_interval": self.cluster_poll_interval}

    @property
    def process(self) -> LocalProcess | None:
        """The local spark-submit process the operator started, if any."""
        if self.submit_pid is None or self.submit_host is None:
            return None
        return LocalProcess(self.submit_pid, self.submit_host, self.submit_start_ticks)

    @property
    def cluster_app(self) -> ClusterApplication | None:
        """The cluster application the operator submitted, if any."""
        return ClusterApplication.from_dict(self.cluster_application)

    def submit_process_exited(self) -> bool:
        """Whether the local spark-submit (client/local mode: it runs the driver) is known to have exited."""
        proc = self.process
        if proc is None or self.submit_exits:
            return False
        return proc.alive() is False

    async def sleep_watching(self, seconds: float) -> None:
        """Sleep ``seconds``, but wake as soon as the local spark-submit exits: its exit is seen at once, not at
        the next poll. Linux only (a pidfd in the event loop); a plain sleep where it cannot be watched (another
        host, a cluster deploy mode's spark-submit that exits by design, no pidfd, a loop without readers)."""
        proc = self.process
        fd: int | None = None
        if proc is not None and not self.submit_exits and proc.on_this_host and hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(proc.pid)
        if fd is None or proc is None:
            await asyncio.sleep(seconds)
            return
        loop = asyncio.get_running_loop()
        try:
            if proc.alive() is False:  # gone already, or the pid is another process's now
                return
            exited: asyncio.Future[None] = loop.create_future()

            def on_exit() -> None:
                if not exited.done():
                    exited.set_result(None)

            try:
                loop.add_reader(fd, on_exit)
            except (NotImplementedError, OSError):
                await asyncio.sleep(seconds)
                return
            try:
                await asyncio.wait_for(exited, seconds)
            except TimeoutError:
                pass
            finally:
                loop.remove_reader(fd)
        finally:
            os.close(fd)

    async def cluster_app_ended(self) -> str | None:
        """What the cluster manager says once the application has ended; None while it runs, when it
        cannot be told, or when it was asked less than ``cluster_poll_interval`` seconds ago."""
        app = self.cluster_app
        if app is None or time.monotonic() - self._cluster_checked_at < self.cluster_poll_interval:
            return None
        self._cluster_checked_at = time.monotonic()
        status = await asyncio.to_thread(app.status)
        if status is None or not status[0]:
            return None
        return status[1]


class PipelineStateTrigger(WatchesSubmission, BaseTrigger):
    """Wait until pipeline ``pipeline_id`` reaches ``state`` (running, stopped, failed) or until an
    epoch numbered ``epoch`` or later has completed; fail at once with the cause if it fails.

    :param pipeline_id: the pipeline to watch.
    :param state: ``running``, ``stopped`` or ``failed`` (exactly one of ``state`` / ``epoch``).
    :param epoch: wait until an epoch >= this number has completed.
    :param run_id: only this run counts (the submit operator waits for the run it started).
    :param conn_id: Airflow connection of the epoch store.
    :param poll_interval: seconds between two looks at the store.
    :param deadline: UNIX time after which a ``timeout`` event is yielded (None: wait forever; a
        sensor uses Airflow's own deferral timeout instead).
    :param heartbeat_timeout: a live pipeline whose driver has not heartbeated for this many
        seconds is presumed dead (``unreachable``). None disables the check.
    :param stop_on_kill: when the user kills the deferred task, request an immediate stop and kill
        the local ``spark-submit`` process group (the submit operator sets it; a sensor does not).
    :param submit_pid: pid (= process group id) of the detached ``spark-submit``, if started here.
    :param submit_host: host name where ``submit_pid`` lives.
    :param submit_start_ticks: kernel start time of ``submit_pid`` (guards against pid reuse).
    :param submit_log: its log file (its tail goes into the failure message).
    :param submit_exits: True when ``spark-submit`` exits once the application is submitted (cluster
        deploy modes): then its exit is not a failure.
    :param cluster_application: a cluster-mode run's handle
        (:class:`~airflow_arroyo.submit.deploy.ClusterApplication` as a dict): while the run has
        not reached the target, its cluster manager is asked every ``cluster_poll_interval`` seconds
        whether the application ended (YARN ResourceManager, driver pod phase); killing the task kills
        it there.
    :param not_before: UNIX time before which no event is yielded (one reached earlier is held):
        the deferring task's settle time, see :mod:`airflow_arroyo.triggers.settle`.
    """

    def __init__(
        self,
        pipeline_id: str,
        state: str | None = None,
        epoch: int | None = None,
        run_id: str | None = None,
        conn_id: str = "arroyo_default",
        poll_interval: float = 5.0,
        deadline: float | None = None,
        heartbeat_timeout: float | None = 300.0,
        stop_on_kill: bool = False,
        submit_pid: int | None = None,
        submit_host: str | None = None,
        submit_start_ticks: int | None = None,
        submit_log: str | None = None,
        submit_exits: bool = False,
        cluster_application: dict[str, Any] | None = None,
        cluster_poll_interval: float = 30.0,
        not_before: float | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # BaseTrigger.__init__ has no annotations
        validate_pipeline_id(pipeline_id)
        target_state, target_epoch = normalize_target(state, epoch)
        if poll_interval <= 0:
            raise ConfigurationError(f"poll_interval must be positive, got {poll_interval!r}")
        self.pipeline_id = pipeline_id
        self.state = target_state.value if target_state is not None else None
        self.epoch = target_epoch
        self.run_id = run_id
        self.conn_id = conn_id
        self.poll_interval = float(poll_interval)
        self.deadline = deadline
        self.heartbeat_timeout = heartbeat_timeout
        self.stop_on_kill = stop_on_kill
        self._watch_submission(submit_pid, submit_host, submit_start_ticks, submit_log, submit_exits,
                               cluster_application, cluster_poll_interval)
        self.not_before = not_before

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """Airflow: the class path and exactly the constructor arguments."""
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {
                "pipeline_id": self.pipeline_id,
                "state": self.state,
                "epoch": self.epoch,
                "run_id": self.run_id,
                "conn_id": self.conn_id,
                "poll_interval": self.poll_interval,
                "deadline": self.deadline,
                "heartbeat_timeout": self.heartbeat_timeout,
                "stop_on_kill": self.stop_on_kill,
                **self._submission_kwargs(),
                "not_before": self.not_before,
            },
        )

    @property
    def target_description(self) -> str:
        """What the trigger waits for, for messages."""
        return f"epoch {self.epoch} completed" if self.epoch is not None else f"state {self.state}"

    async def _store(self) -> AsyncEpochStore:
        return await open_async_store(self.conn_id)

    async def look(self, store: AsyncEpochStore) -> tuple[WaitVerdict, PipelineRecord | None, int | None]:
        """One look at the store: the pipeline, its latest completed epoch, the verdict."""
        try:
            pipeline: PipelineRecord | None = await store.get_pipeline(self.pipeline_id)
        except UnknownPipelineError:
            pipeline = None
        latest: int | None = None
        age: float | None = None
        if pipeline is not None:
            record = await store.latest_completed_epoch(self.pipeline_id)
            latest = record.epoch if record is not None else None
            if pipeline.heartbeat_at is not None and self.heartbeat_timeout is not None:
                age = ((await store.db_now()) - pipeline.heartbeat_at).total_seconds()
        target_state = PipelineState(self.state) if self.state is not None else None
        verdict = evaluate_wait(pipeline, state=target_state, epoch=self.epoch, run_id=self.run_id,
                                latest_completed=latest, heartbeat_age=age,
                                heartbeat_timeout=self.heartbeat_timeout)
        return verdict, pipeline, latest

    def _event(self, status: str, message: str, pipeline: PipelineRecord | None, latest: int | None,
               cause: str | None = None) -> TriggerEvent:
        return TriggerEvent({
            "status": status,
            "pipeline_id": self.pipeline_id,
            "run_id": pipeline.run_id if pipeline is not None else self.run_id,
            "state": pipeline.state.value if pipeline is not None else None,
            "latest_epoch": latest,
            "message": message,
            "cause": cause,
            "spark_ui_url": pipeline.spark_ui_url if pipeline is not None else None,
            "spark_app_id": pipeline.spark_app_id if pipeline is not None else None,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Airflow: wait for the target, then yield one event."""
        event = await self._wait()
        await hold_until(self.not_before, self.log, self.pipeline_id)
        yield event

    async def _wait(self) -> TriggerEvent:
        store = await self._store()
        self.log.info("Waiting for pipeline %s (run %s) to reach %s", self.pipeline_id, self.run_id or "any",
                      self.target_description)
        last_message = ""
        while True:
            try:
                verdict, pipeline, latest = await self.look(store)
            except ArroyoError as exc:
                return self._event("error", f"epoch store error while watching {self.pipeline_id!r}: {exc}", None, None)
            if verdict.verdict is Verdict.WAIT and self.submit_process_exited():
                # The process may have written its last state just before it exited: look once more.
                verdict, pipeline, latest = await self.look(store)
                if verdict.verdict is Verdict.WAIT:
                    tail = await asyncio.to_thread(log_tail, self.submit_log, settle=2.0)  # its last lines written
                    error = driver_error(tail)
                    msg = (f"{error} (" if error else "") + (
                        f"spark-submit (pid {self.submit_pid}) exited before pipeline {self.pipeline_id!r} "
                        f"reached {self.target_description} ({verdict.message}); see {self.submit_log}")
                    msg += ")" if error else ""
                    if tail:
                        msg += f"; its last lines:\n{tail}"
                    verdict, pipeline = await self._submission_ended(store, msg, pipeline)
            if verdict.verdict is Verdict.WAIT and (ended := await self.cluster_app_ended()) is not None:
                verdict, pipeline, latest = await self.look(store)
                if verdict.verdict is Verdict.WAIT:
                    verdict, pipeline = await self._submission_ended(store, (
                        f"the application of pipeline {self.pipeline_id!r} ended before it reached "
                        f"{self.target_description}: {ended}; see the driver's log on the cluster"), pipeline)
            if verdict.verdict is not Verdict.WAIT:
                self.log.info("Pipeline %s: %s", self.pipeline_id, verdict.message)
                return self._event(verdict.verdict.value, verdict.message, pipeline, latest, verdict.cause)
            if verdict.message != last_message:
                self.log.info("Pipeline %s: %s; waiting for %s", self.pipeline_id, verdict.message,
                              self.target_description)
                last_message = verdict.message
            if self.deadline is not None and time.time() >= self.deadline:
                msg = (f"pipeline {self.pipeline_id!r} did not reach {self.target_description} by "
                       f"{datetime.fromtimestamp(self.deadline).isoformat(timespec='seconds')} ({verdict.message})")
                return self._event("timeout", msg, pipeline, latest)
            await self.sleep_watching(self.poll_interval)

    async def _submission_ended(self, store: AsyncEpochStore, message: str,
                                pipeline: PipelineRecord | None) -> tuple[WaitVerdict, PipelineRecord | None]:
        """The submission this trigger watches ended before its run reached the target: record the run
        failed with ``message`` at once (:meth:`~airflow_arroyo.store.EpochStore.fail_run`; a run that never
        registered too), so that the other tasks waiting for it (the checkpoint controller, sensors) fail
        now with the same cause instead of waiting for their registration timeout."""
        if self.run_id is not None:
            try:
                recorded = await store.fail_run(self.pipeline_id, self.run_id, message, never_registered=True)
            except ArroyoError as exc:
                self.log.warning("Pipeline %s: could not record the failure of run %s: %s", self.pipeline_id,
                                 self.run_id, exc)
            else:
                pipeline = recorded or pipeline
        return WaitVerdict(Verdict.UNREACHABLE, message), pipeline

    async def on_kill(self) -> None:
        """The user killed the deferred task: stop what the task started (only with ``stop_on_kill``)."""
        if not self.stop_on_kill:
            return
        store = await self._store()
        await store.call(stop_run, self.pipeline_id, self.run_id, self.process, log=self.log,
                         cluster_app=self.cluster_app)


def stop_run(store: EpochStore, pipeline_id: str, run_id: str | None, process: LocalProcess | None,
             *, log: Any, grace: float = 10.0, cluster_app: ClusterApplication | None = None) -> None:
    """Ask run ``run_id`` of the pipeline to stop immediately, then end what runs it: the local
    spark-submit process group (SIGTERM, SIGKILL after ``grace`` seconds), or a cluster-mode
    application through its cluster manager if it has not stopped within ``grace`` seconds. Used when
    the user kills the task and when a submit fails. Blocking: triggers call it in a thread."""
    try:
        pipeline: PipelineRecord | None = store.get_pipeline(pipeline_id)
    except UnknownPipelineError:
        pipeline = None
    ours = pipeline is not None and (run_id is None or pipeline.run_id == run_id)
    if pipeline is not None and ours and not pipeline.state.terminal:
        log.info("Requesting an immediate stop of pipeline %s (run %s)", pipeline_id, pipeline.run_id)
        store.request_stop(pipeline_id, "immediate")
    if cluster_app is not None:
        deadline = time.monotonic() + grace
        while ours and time.monotonic() < deadline and not store.get_pipeline(pipeline_id).state.terminal:
            time.sleep(0.5)
        if not ours or not store.get_pipeline(pipeline_id).state.terminal:
            cluster_app.kill(log)
        return
    if process is None or not process.on_this_host:
        return
    if process.signal_group(signal.SIGTERM):
        log.info("Sent SIGTERM to spark-submit process group %s of pipeline %s", process.pid, pipeline_id)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and process.group_alive():
            time.sleep(0.2)
        if process.group_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            log.warning("spark-submit process group %s of pipeline %s killed (SIGKILL)", process.pid, pipeline_id)
