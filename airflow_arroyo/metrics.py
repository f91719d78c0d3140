"""Metrics of the checkpoint controller through Airflow's ``Stats`` (statsd or OpenTelemetry, as
``[metrics]`` configures), emitted from the triggerer: the Spark driver never talks to Airflow.

Every name is ``arroyo.<pipeline_id>.<metric>`` (under Airflow's ``[metrics] statsd_prefix``) and
carries the tag ``pipeline_id`` where the backend supports tags:

=============================== ======= ==============================================================
metric                          type    what
=============================== ======= ==============================================================
``epoch.duration``              timing  trigger to completion of a completed epoch
``epoch.size``                  gauge   bytes of the completed epoch's snapshot (all stages)
``epoch.bytes_new``             gauge   bytes the epoch uploaded (new snapshot objects)
``epoch.alignment``             timing  the longest barrier alignment among the epoch's stages
``epoch.completed``             counter completed epochs
``epoch.failed``                counter failed or expired epochs (``outcome`` tag: failed/expired)
``trigger.lateness``            timing  how much later than due an epoch started (interval overrun)
``pipeline.heartbeat_age``      gauge   seconds since the driver's last heartbeat, at each epoch end
``pipeline.failed``             counter the controller saw the pipeline fail
=============================== ======= ==============================================================
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from airflow_arroyo.store import AckRecord, EpochRecord

__all__ = ["EpochMetrics", "slowest_alignment"]


def slowest_alignment(acks: list[AckRecord]) -> float | None:
    """The longest barrier alignment among an epoch's acknowledgements (ms), None if none reported one."""
    return max((a.alignment_ms for a in acks if a.alignment_ms is not None), default=None)


def _stats() -> Any:
    from airflow.providers.common.compat.sdk import Stats

    return Stats


class EpochMetrics:
    """The metrics of one pipeline. ``stats`` is a seam: anything with ``timing``/``gauge``/``incr``."""

    def __init__(self, pipeline_id: str, stats: Any = None) -> None:
        self.pipeline_id = pipeline_id
        self.stats = stats if stats is not None else _stats()
        self.tags = {"pipeline_id": pipeline_id}
        self.last_started: datetime | None = None

    def _name(self, metric: str) -> str:
        return f"arroyo.{self.pipeline_id}.{metric}"

    def epoch_started(self, rec: EpochRecord, interval: float) -> None:
        """Lateness: the start minus the instant it was due (the previous start plus the interval)."""
        if self.last_started is not None:
            late = (rec.triggered_at - self.last_started).total_seconds() - interval
            self.stats.timing(self._name("trigger.lateness"), timedelta(seconds=max(0.0, late)), tags=self.tags)
        self.last_started = rec.triggered_at

    def epoch_ended(self, rec: EpochRecord, outcome: str, alignment_ms: float | None,
                    heartbeat_at: datetime | None, now: datetime) -> None:
        """Record an ended epoch: outcome count, duration, sizes and the slowest stage's barrier alignment
        (``alignment_ms``, :func:`slowest_alignment`)."""
        if outcome == "completed":
            self.stats.incr(self._name("epoch.completed"), tags=self.tags)
            if rec.duration_s is not None:
                self.stats.timing(self._name("epoch.duration"), timedelta(seconds=rec.duration_s), tags=self.tags)
            if rec.bytes_total is not None:
                self.stats.gauge(self._name("epoch.size"), rec.bytes_total, tags=self.tags)
            if rec.bytes_new is not None:
                self.stats.gauge(self._name("epoch.bytes_new"), rec.bytes_new, tags=self.tags)
            if alignment_ms is not None:
                self.stats.timing(self._name("epoch.alignment"), timedelta(milliseconds=alignment_ms),
                                  tags=self.tags)
        else:
            self.stats.incr(self._name("epoch.failed"), tags={**self.tags, "outcome": outcome})
        if heartbeat_at is not None:
            self.stats.gauge(self._name("pipeline.heartbeat_age"), max(0.0, (now - heartbeat_at).total_seconds()),
                             tags=self.tags)

    def pipeline_failed(self) -> None:
        """Count a failed pipeline run."""
        self.stats.incr(self._name("pipeline.failed"), tags=self.tags)
