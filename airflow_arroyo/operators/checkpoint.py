"""The checkpoint controller as a deferrable task.

:class:`CheckpointOperator` defers at once to :class:`~airflow_arroyo.triggers.checkpoint.CheckpointTrigger`,
which fires the pipeline's epochs from the triggerer for as long as the pipeline runs. When the
pipeline stops, the task resumes in :meth:`CheckpointOperator.execute_complete`, writes one summary
line (epochs completed, failed, expired; p50/p99 of duration and size) to the task log and succeeds
(the trigger's log, which Airflow shows in the task log, has one line per epoch as it ended); it fails with an
``AirflowException`` (its ``__cause__`` says why) when the pipeline failed or too many consecutive
epochs failed. Put it beside the task that runs the pipeline::

    run = SparkSubmitOperator(task_id="run_pipeline", ...)
    checkpoints = CheckpointOperator(task_id="checkpoints", pipeline_id="orders", interval=30,
                                     pipeline_run_id="{{ run_id }}")

The task's extra link "Arroyo checkpoints" opens the pipeline's page of the Airflow UI plugin.

Always deferrable (no ``deferrable`` argument, unlike the submit/stop operators and the sensor): it
lives as long as the pipeline, and a worker slot held for days is not a mode worth offering. Its
trigger also reports the epoch metrics (:mod:`airflow_arroyo.metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseOperatorLink
from airflow.sdk.exceptions import AirflowException

from airflow_arroyo import config
from airflow_arroyo.core.epochs import CheckpointPolicy, validate_pipeline_id
from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, PipelineFailedError
from airflow_arroyo.core.summary import summarize
from airflow_arroyo.core.units import bytes_human, duration_human
from airflow_arroyo.links.pipeline import pipeline_page_url
from airflow_arroyo.triggers.checkpoint import CheckpointTrigger
from airflow_arroyo.triggers.settle import settle_deadline

if TYPE_CHECKING:
    from airflow.sdk import Context
    from airflow.sdk.types import TaskInstanceKey

__all__ = ["ArroyoCheckpointsLink", "CheckpointOperator"]


class ArroyoCheckpointsLink(BaseOperatorLink):
    """Extra link of a checkpoint task: the pipeline's epochs in the Airflow UI plugin, at
    ``<[api] base_url>/arroyo/pipelines/<pipeline_id>`` (relative to the UI when no base URL is set)."""

    name = "Arroyo checkpoints"

    def get_link(self, operator: BaseOperator, *, ti_key: TaskInstanceKey) -> str:  # noqa: ARG002 - Airflow's signature
        """Airflow: the checkpoint page of the operator's pipeline ("" when templated or unknown)."""
        pipeline_id = getattr(operator, "pipeline_id", None)
        if not isinstance(pipeline_id, str) or not pipeline_id or _templated(pipeline_id):
            return ""
        return pipeline_page_url(pipeline_id)


def _templated(value: object) -> bool:
    return isinstance(value, str) and ("{{" in value or "{%" in value)


def _number(name: str, value: Any, *, optional: bool = False) -> Any:
    """Rendered templates are strings: turn '30' into 30.0; leave numbers (and None) alone."""
    if value is None and optional:
        return None
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            raise ConfigurationError(f"{name} must be a number of seconds, got {value!r}") from None
    return value


class CheckpointOperator(BaseOperator):
    """Fire checkpoint epochs of a running pipeline until it stops (deferrable; runs in the triggerer).

    :param pipeline_id: the pipeline (as registered by its driver). Templated.
    :param conn_id: an ``arroyo`` or ``postgres`` connection to the epoch store (default ``[arroyo] conn_id``).
        Templated.
    :param interval: the checkpoint interval in seconds: one epoch per interval, on a fixed-rate schedule
        (default ``[arroyo] checkpoint_interval``).
        Templated.
    :param timeout: seconds after which an unfinished epoch expires (default: ten intervals, at least
        60 s; never below the interval). Templated.
    :param min_pause: seconds between the end of an epoch and the start of the next. Templated.
    :param tolerable_failures: consecutive failed/expired epochs tolerated; one more fails the task.
        Templated.
    :param poll_interval: longest sleep of the trigger between two looks (default: the interval, at
        most 5 s). Templated.
    :param pipeline_run_id: the run of the pipeline to control, e.g. ``"{{ run_id }}"`` when the
        pipeline's driver registers with the DAG run id; an earlier run that already stopped is then
        not mistaken for this one. Templated.
    :param registration_timeout: seconds to wait for the pipeline (run) to register before failing; also how
        long a supervised restart may take to register once due before it is declared failed.
    :param stop_after_epochs: request a graceful stop so that the pipeline's final epoch is the N-th
        completed epoch of this controller (e.g. ``"{{ params.epochs }}"``); None: run until stopped.
        Templated.
    """

    template_fields: Sequence[str] = (
        "pipeline_id", "conn_id", "interval", "timeout", "min_pause", "tolerable_failures", "poll_interval",
        "pipeline_run_id", "stop_after_epochs",
    )
    operator_extra_links = (ArroyoCheckpointsLink(),)
    ui_color = "#cfe8fc"

    def __init__(
        self,
        *,
        pipeline_id: str,
        conn_id: str | None = None,
        interval: float | str | None = None,
        timeout: float | str | None = None,
        min_pause: float | str = 0.0,
        tolerable_failures: int | str = 3,
        poll_interval: float | str | None = None,
        pipeline_run_id: str | None = None,
        registration_timeout: float = 600.0,
        stop_after_epochs: int | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_id = pipeline_id
        self.conn_id = conn_id or config.get("conn_id")
        self.interval = config.get_float("checkpoint_interval") if interval is None else interval
        self.timeout = timeout
        self.min_pause = min_pause
        self.tolerable_failures = tolerable_failures
        self.poll_interval = poll_interval
        self.pipeline_run_id = pipeline_run_id
        self.registration_timeout = registration_timeout
        self.stop_after_epochs = stop_after_epochs
        # Bad input fails when the DAG is parsed, before anything is written. Templated values are
        # checked once rendered, in execute().
        if not any(_templated(v) for v in (pipeline_id, interval, timeout, min_pause, tolerable_failures,
                                            poll_interval, stop_after_epochs)):
            self._trigger_kwargs()

    def _trigger_kwargs(self) -> dict[str, Any]:
        """The validated arguments of the trigger (from the rendered fields)."""
        validate_pipeline_id(self.pipeline_id)
        interval = _number("interval", self.interval)
        timeout = _number("timeout", self.timeout, optional=True)
        min_pause = _number("min_pause", self.min_pause)
        poll = _number("poll_interval", self.poll_interval, optional=True)
        failures: Any = self.tolerable_failures
        if isinstance(failures, str):
            if not failures.strip().isdigit():
                raise ConfigurationError(f"tolerable_failures must be a whole number >= 0, got {failures!r}")
            failures = int(failures)
        CheckpointPolicy(interval=interval, timeout=timeout, min_pause=min_pause, tolerable_failures=failures)
        stop_after: Any = self.stop_after_epochs
        if isinstance(stop_after, str):
            stop_after = stop_after.strip()
            if stop_after.lower() in ("", "none"):
                stop_after = None
            elif stop_after.isdigit():
                stop_after = int(stop_after)
        if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int)
                                       or stop_after < 1):
            raise ConfigurationError(f"stop_after_epochs must be a whole number >= 1, got {self.stop_after_epochs!r}")
        if poll is not None and not (isinstance(poll, int | float) and poll > 0):
            raise ConfigurationError(f"poll_interval must be a positive number of seconds, got {poll!r}")
        return {
            "pipeline_id": self.pipeline_id, "conn_id": self.conn_id, "interval": interval, "timeout": timeout,
            "min_pause": min_pause, "tolerable_failures": failures, "poll_interval": poll,
            "pipeline_run_id": self.pipeline_run_id or None, "registration_timeout": self.registration_timeout,
            "stop_after_epochs": stop_after,
        }

    def execute(self, context: Context) -> None:
        """Airflow: defer to the checkpoint trigger (always: it runs in the triggerer)."""
        kwargs = self._trigger_kwargs()
        ti = context["ti"]
        triggered_by = f"airflow:{ti.dag_id}/{ti.task_id}/{ti.run_id}"
        self.log.info(
            "pipeline %s: handing the checkpoint controller to the triggerer (every %ss, timeout %ss, "
            "min pause %ss, %s consecutive failures tolerated); epochs are listed here when it ends: %s",
            self.pipeline_id, kwargs["interval"],
            CheckpointPolicy(interval=kwargs["interval"], timeout=kwargs["timeout"]).effective_timeout,
            kwargs["min_pause"], kwargs["tolerable_failures"], pipeline_page_url(self.pipeline_id),
        )
        self.defer(trigger=CheckpointTrigger(**kwargs, triggered_by=triggered_by, not_before=settle_deadline()),
                   method_name="execute_complete")

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG002 - Airflow's
        """One summary line (the trigger's log above has a line per epoch); fail on a failure event."""
        pipeline_id = str(event.get("pipeline_id") or self.pipeline_id)
        summary = event.get("summary") or {}
        counts = {k: int(summary.get(k, 0)) for k in ("completed", "failed", "expired")}
        self.log.info("%s", summary_line(event, pipeline_id))
        if event.get("status") != "success":
            cause: ArroyoError
            if event.get("reason") == "pipeline_failed":
                cause = PipelineFailedError(pipeline_id, event.get("cause"))
            else:
                cause = ArroyoError(str(event.get("message") or "checkpoint controller failed"))
            raise AirflowException(f"checkpoint controller of pipeline {pipeline_id} failed: "
                                   f"{event.get('message')}") from cause
        epochs = summary.get("epochs", [])
        return {
            "pipeline_id": pipeline_id,
            "pipeline_run_id": event.get("pipeline_run_id"),
            **counts,
            "last_epoch": epochs[-1]["epoch"] if epochs else None,
        }


def summary_line(event: dict[str, Any], pipeline_id: str) -> str:
    """``pipeline orders stopped: 5 epochs completed, 0 failed, 0 expired; duration p50 1.2 s, p99 2.0 s;
    size p50 3.4 MiB, p99 3.6 MiB`` (figures of the epochs listed in the event)."""
    summary = event.get("summary") or {}
    counts = {k: int(summary.get(k, 0)) for k in ("completed", "failed", "expired")}
    figures = summarize((e.get("state", ""), e.get("duration_s"), e.get("bytes_total"))
                        for e in summary.get("epochs", []))
    outcome = {"pipeline_stopped": "stopped", "pipeline_failed": "failed"}.get(str(event.get("reason")),
                                                                              "controller ended")
    line = (f"pipeline {pipeline_id} {outcome}: {counts['completed']} epochs completed, {counts['failed']} failed, "
            f"{counts['expired']} expired")
    if figures.duration_p50_s is not None:
        line += (f"; duration p50 {duration_human(figures.duration_p50_s)}, "
                 f"p99 {duration_human(figures.duration_p99_s)}")
    if figures.size_p50 is not None:
        line += f"; size p50 {bytes_human(figures.size_p50)}, p99 {bytes_human(figures.size_p99)}"
    if event.get("status") != "success":
        line += f"; {event.get('message')}"
    return line
