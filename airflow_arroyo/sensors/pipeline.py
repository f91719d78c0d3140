"""``PipelineSensor``: wait for a pipeline state (running, stopped, failed) or for epoch N completed.

Deferrable when ``deferrable=True`` (default: ``[operators] default_deferrable``): one look at the
epoch store in the worker (done already? then no deferral),
then :class:`~airflow_arroyo.triggers.pipeline.PipelineStateTrigger` waits in the triggerer without
holding a worker slot. With ``deferrable=False`` it pokes like any sensor (``poke_interval``).

* A pipeline that **fails** fails the sensor at once with the driver's cause
  (:class:`~airflow_arroyo.core.exceptions.PipelineFailedError`; ``soft_fail`` does not hide it).
* A pipeline that ends without reaching the target (stopped before epoch N), or whose driver stopped
  heartbeating, fails it too, saying so.
* Running out of time is an ordinary sensor timeout (``AirflowSensorTimeout``; skipped with
  ``soft_fail``). ``wait_timeout`` is a templated alternative to ``timeout``, e.g. a DAG param.

``epoch=N`` is satisfied when an epoch numbered N **or later** has completed: a checkpoint at
least that recent exists (an expired epoch N followed by a completed N+1 counts).

Usage::

    wait_running = PipelineSensor(task_id="wait_running", pipeline_id="orders", state="running")
    run_for = PipelineSensor(task_id="run_for", pipeline_id="orders", epoch="{{ params.epochs }}",
                             wait_timeout="{{ params.minutes * 60 }}", soft_fail=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue

from airflow_arroyo import config
from airflow_arroyo.config import default_deferrable
from airflow_arroyo.core.epochs import PipelineState, validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, PipelineFailedError, UnknownPipelineError
from airflow_arroyo.links.pipeline import XCOM_PIPELINE_ID, ArroyoPipelineLink
from airflow_arroyo.triggers.pipeline import (
    PipelineStateTrigger,
    Verdict,
    WaitVerdict,
    evaluate_wait,
    normalize_target,
)
from airflow_arroyo.triggers.settle import settle_deadline

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.store import EpochStore, PipelineRecord

__all__ = ["PipelineSensor", "look"]


def look(store: EpochStore, pipeline_id: str, *, state: PipelineState | None, epoch: int | None,
         run_id: str | None, heartbeat_timeout: float | None) -> tuple[WaitVerdict, PipelineRecord | None, int | None]:
    """One synchronous look at the store (the twin of the trigger's)."""
    try:
        pipeline: PipelineRecord | None = store.get_pipeline(pipeline_id)
    except UnknownPipelineError:
        pipeline = None
    latest: int | None = None
    age: float | None = None
    if pipeline is not None:
        record = store.latest_completed_epoch(pipeline_id)
        latest = record.epoch if record is not None else None
        if pipeline.heartbeat_at is not None and heartbeat_timeout is not None:
            age = (store.db_now() - pipeline.heartbeat_at).total_seconds()
    verdict = evaluate_wait(pipeline, state=state, epoch=epoch, run_id=run_id, latest_completed=latest,
                            heartbeat_age=age, heartbeat_timeout=heartbeat_timeout)
    return verdict, pipeline, latest


class PipelineSensor(BaseSensorOperator):
    """Wait until a pipeline reaches ``state`` or until epoch ``epoch`` (or a later one) completed.

    :param pipeline_id: the pipeline to watch.
    :param state: ``running``, ``stopped`` or ``failed`` (give exactly one of ``state`` / ``epoch``).
    :param epoch: wait until an epoch numbered this or later has completed.
    :param run_id: only this run of the pipeline counts (e.g.
        ``"{{ ti.xcom_pull(task_ids='submit', key='run_id') }}"``).
    :param conn_id: Airflow connection of the epoch store (default ``[arroyo] conn_id``).
    :param deferrable: wait in the triggerer instead of poking from a worker slot (default:
        ``[operators] default_deferrable``).
    :param wait_timeout: seconds before the sensor times out; templated, overrides ``timeout``.
    :param trigger_poll_interval: seconds between two looks at the store while deferred.
    :param heartbeat_timeout: a live pipeline whose driver has not heartbeated for this long is
        presumed dead and fails the sensor (None: never).

    The XCom value is a dict: ``pipeline_id``, ``run_id``, ``state``, ``latest_epoch``, ``message``.
    """

    template_fields: Sequence[str] = ("pipeline_id", "state", "epoch", "run_id", "conn_id", "wait_timeout")
    operator_extra_links = (ArroyoPipelineLink(),)
    ui_color = "#e8eef4"

    def __init__(
        self,
        *,
        pipeline_id: str,
        state: str | None = None,
        epoch: int | str | None = None,
        run_id: str | None = None,
        conn_id: str | None = None,
        deferrable: bool | None = None,
        wait_timeout: float | str | None = None,
        trigger_poll_interval: float = 5.0,
        heartbeat_timeout: float | None = 300.0,
        poke_interval: timedelta | float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(poke_interval=poke_interval, **kwargs)
        self.pipeline_id = pipeline_id
        self.state = state
        self.epoch = epoch
        self.run_id = run_id
        self.conn_id = conn_id or config.get("conn_id")
        self.deferrable = default_deferrable() if deferrable is None else deferrable
        self.wait_timeout = wait_timeout
        self.trigger_poll_interval = trigger_poll_interval
        self.heartbeat_timeout = heartbeat_timeout
        if "{{" not in str(state) and "{{" not in str(epoch):  # fail at parse time, naming the task
            try:
                normalize_target(state, epoch)
            except ConfigurationError as exc:
                raise ConfigurationError(f"task {self.task_id!r}: {exc}") from None

    def _target(self) -> tuple[PipelineState | None, int | None]:
        validate_pipeline_id(self.pipeline_id)
        return normalize_target(self.state, self.epoch)

    def _timeout(self) -> float:
        if self.wait_timeout in (None, ""):
            return float(self.timeout)
        try:
            seconds = float(str(self.wait_timeout))
        except ValueError:
            seconds = -1.0
        if seconds <= 0:
            raise ConfigurationError(f"wait_timeout must be a positive number of seconds, got {self.wait_timeout!r}")
        return seconds

    def _store(self) -> EpochStore:
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return ArroyoHook(self.conn_id).get_store()

    def _look(self) -> tuple[WaitVerdict, PipelineRecord | None, int | None]:
        state, epoch = self._target()
        return look(self._store(), self.pipeline_id, state=state, epoch=epoch, run_id=self.run_id or None,
                    heartbeat_timeout=self.heartbeat_timeout)

    def _result(self, verdict: WaitVerdict, pipeline: PipelineRecord | None, latest: int | None) -> dict[str, Any]:
        return {"status": verdict.verdict.value, "pipeline_id": self.pipeline_id,
                "run_id": pipeline.run_id if pipeline is not None else self.run_id,
                "state": pipeline.state.value if pipeline is not None else None,
                "latest_epoch": latest, "message": verdict.message, "cause": verdict.cause}

    def execute(self, context: Context) -> Any:
        """Airflow: poke once, then defer until the target state or epoch (or fail at once with the cause)."""
        self._target()
        timeout = self._timeout()
        self.timeout = timeout
        context["ti"].xcom_push(key=XCOM_PIPELINE_ID, value=self.pipeline_id)
        if not self.deferrable:
            return super().execute(context)
        verdict, pipeline, latest = self._look()
        if verdict.verdict is not Verdict.WAIT:
            return self.execute_complete(context, self._result(verdict, pipeline, latest))
        self.log.info("Pipeline %s: %s; deferring", self.pipeline_id, verdict.message)
        state, epoch = self._target()
        self.defer(
            trigger=PipelineStateTrigger(
                pipeline_id=self.pipeline_id, state=state.value if state else None, epoch=epoch,
                run_id=self.run_id or None, conn_id=self.conn_id, poll_interval=self.trigger_poll_interval,
                heartbeat_timeout=self.heartbeat_timeout, not_before=settle_deadline(),
            ),
            method_name="execute_complete",
            timeout=timedelta(seconds=timeout),
        )

    def poke(self, context: Context) -> Any:
        """Airflow: True once the pipeline reached the target; fails at once when it cannot anymore."""
        verdict, pipeline, latest = self._look()
        if verdict.verdict is Verdict.WAIT:
            self.log.info("Pipeline %s: %s", self.pipeline_id, verdict.message)
            return False
        return PokeReturnValue(True, self.execute_complete(context, self._result(verdict, pipeline, latest)))

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG002 - Airflow's
        """Airflow: the end of the deferral; returns the verdict, or fails with the cause."""
        status = event.get("status")
        message = event.get("message") or ""
        if status == Verdict.SUCCESS.value:
            self.log.info("%s", message)
            return {k: event.get(k) for k in ("pipeline_id", "run_id", "state", "latest_epoch", "message")}
        if status == Verdict.FAILED.value:
            raise PipelineFailedError(self.pipeline_id, event.get("cause") or message)
        if status == "timeout":
            from airflow.sdk.exceptions import AirflowSensorTimeout

            raise AirflowSensorTimeout(message)
        raise ArroyoError(message or f"waiting for pipeline {self.pipeline_id!r} failed ({status})")
