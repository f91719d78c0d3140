"""``PruneEpochsOperator``: one retention run of one pipeline, from Airflow.

Usage (see ``dags/arroyo_retention.py`` for the scheduled DAG with one mapped task per pipeline)::

    from datetime import timedelta
    from airflow_arroyo.operators.retention import PruneEpochsOperator

    PruneEpochsOperator(
        task_id="prune_orders",
        pipeline_id="orders",
        keep_last=10,                         # the last 10 completed epochs ...
        keep_newer_than=timedelta(hours=6),   # ... and every epoch of the last 6 hours
        conn_id="arroyo_default",               # default: [arroyo] conn_id
    )

``keep_last`` and ``keep_newer_than`` are templated: ``keep_newer_than`` may be a timedelta, seconds,
or text such as ``"6h"`` / ``"1h30m"`` (handy from Variables:
``keep_newer_than="{{ var.value.get('arroyo_keep_newer_than', '6h') }}"``). The policy is
checked at the start of ``execute``, before the epoch store is touched; a policy that keeps nothing
or an unknown pipeline fails the task without retries. The return value (XCom) is the run's report:
``{"pipeline_id", "cleanup_run", "epochs_pruned", "bytes_freed", "kept", "skipped_reason", ...}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_arroyo import config
from airflow_arroyo.core.epochs import validate_pipeline_id
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.core.retention import DEFAULT_COMPACT_AFTER, parse_duration, policy_from, prune_pipeline

if TYPE_CHECKING:
    from airflow.sdk import Context

    from airflow_arroyo.hooks.arroyo import ArroyoHook

__all__ = ["PruneEpochsOperator"]


class PruneEpochsOperator(BaseOperator):
    """Prune the checkpoint epochs of ``pipeline_id`` that the retention policy does not keep.

    Holds the pipeline's cleanup lock (a lease of ``lock_ttl`` seconds, renewed while it works) for
    the whole run; the checkpoint trigger starts no epoch meanwhile. Deletes the snapshot objects
    only pruned epochs reference and the channel data before the oldest retained cursor, marks the
    epochs ``pruned`` and returns a report. Never prunes the latest completed epoch or an in-flight
    one; failed and expired epochs are always pruned.

    :param pipeline_id: the pipeline (templated).
    :param keep_last: keep the last K completed epochs (templated).
    :param keep_newer_than: keep epochs that ended within this duration (templated; timedelta,
        seconds, or text like ``"1h"``). At least one of ``keep_last`` / ``keep_newer_than``.
    :param conn_id: the epoch store connection (``arroyo`` or ``postgres`` type).
    :param lock_ttl: seconds of the cleanup lease; a crashed run blocks checkpoints at most this long.
    :param lock_wait: how long to retry while another cleanup run holds the lock, then skip.
    :param in_flight_wait: how long to wait for an in-flight epoch to end, then skip.
    :param scrub_budget: after pruning, re-hash snapshot objects for at most this long (templated;
        timedelta, seconds or text like ``"60s"``; None or empty: no scrub), least recently verified first;
        damaged epochs are logged as errors and returned in ``damaged_epochs`` (docs/retention.md).
    :param compact_after: after pruning, delete pruned epochs, history and cleanup runs that retention
        released longer ago than this (templated; default 7 days; None or ``"none"``: keep them all).
    """

    template_fields: Sequence[str] = ("pipeline_id", "keep_last", "keep_newer_than", "conn_id", "scrub_budget",
                                     "compact_after")
    ui_color = "#e8f4f8"

    def __init__(
        self,
        *,
        pipeline_id: str,
        keep_last: int | str | None = None,
        keep_newer_than: timedelta | float | str | None = None,
        conn_id: str | None = None,
        lock_ttl: float = 60.0,
        lock_wait: timedelta | float = timedelta(minutes=2),
        in_flight_wait: timedelta | float = timedelta(minutes=5),
        scrub_budget: timedelta | float | str | None = None,
        compact_after: timedelta | float | str | None = DEFAULT_COMPACT_AFTER,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pipeline_id = pipeline_id
        self.keep_last = keep_last
        self.keep_newer_than = keep_newer_than
        self.conn_id = conn_id or config.get("conn_id")
        self.lock_ttl = lock_ttl
        self.lock_wait = lock_wait
        self.in_flight_wait = in_flight_wait
        self.scrub_budget = scrub_budget
        self.compact_after = compact_after
        # Bad input fails when the DAG is parsed, naming the task; templated values once rendered.
        if not any(isinstance(v, str) and ("{{" in v or "{%" in v) for v in (keep_last, keep_newer_than)):
            try:
                policy_from(keep_last, keep_newer_than)
            except ConfigurationError as exc:
                raise ConfigurationError(f"task {self.task_id!r}: {exc}") from None

    @cached_property
    def hook(self) -> ArroyoHook:
        """The hook of ``conn_id``."""
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return ArroyoHook(self.conn_id)

    def execute(self, context: Context) -> dict[str, Any]:
        """Airflow: prune the pipeline under its cleanup lease, then scrub within the budget."""
        try:
            validate_pipeline_id(self.pipeline_id)
            policy = policy_from(self.keep_last, self.keep_newer_than)
            lock_wait = parse_duration(self.lock_wait, name="lock_wait") or timedelta(0)
            in_flight_wait = parse_duration(self.in_flight_wait, name="in_flight_wait") or timedelta(0)
            scrub = parse_duration(self.scrub_budget or None, name="scrub_budget")
            compact_after = parse_duration(self.compact_after, name="compact_after")
            if scrub is not None and scrub.total_seconds() <= 0:
                raise ConfigurationError(
                    f"scrub_budget must be a positive duration such as 60s, got {self.scrub_budget!r}")
        except ConfigurationError as exc:
            # retrying cannot fix the task's own arguments
            raise AirflowFailException(f"retention of pipeline {self.pipeline_id!r}: {exc}") from exc
        try:
            report = prune_pipeline(
                self.hook.get_store(),
                self.pipeline_id,
                policy,
                holder=_holder(context),
                lock_ttl=self.lock_ttl,
                wait_for_lock=lock_wait,
                wait_for_in_flight=in_flight_wait,
                scrub_budget=scrub.total_seconds() if scrub is not None else None,
                compact_after=compact_after,
            )
        except (ConfigurationError, UnknownPipelineError) as exc:
            raise AirflowFailException(str(exc)) from exc
        if report.skipped:
            self.log.warning("pipeline %s: retention skipped: %s", self.pipeline_id, report.skipped_reason)
        else:
            self.log.info("pipeline %s: pruned epochs %s, %s bytes freed; kept epochs %s",
                          self.pipeline_id, report.epochs_pruned, report.bytes_freed, report.kept)
        if report.scrub is not None:
            level = self.log.error if report.damaged_epochs else self.log.info
            level("pipeline %s: scrub verified %s objects: %s", self.pipeline_id, report.objects_verified,
                  report.scrub)
        return report.to_dict()


def _holder(context: Context) -> str:
    """The lease holder name: where this run comes from (shown by ``airflow-arroyo lock``)."""
    ti = context.get("ti")
    if ti is None:
        return "airflow"
    map_index = getattr(ti, "map_index", -1)
    suffix = f"[{map_index}]" if map_index is not None and map_index >= 0 else ""
    return f"airflow:{ti.dag_id}/{ti.task_id}{suffix}/{ti.run_id}"
