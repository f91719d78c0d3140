"""Pure: which warnings a pipeline deserves, from facts already read (no I/O, no clock of its own).

The rules, each one :class:`Finding` kind:

* ``failed`` (critical): the pipeline's run failed.
* ``failing`` (warning; critical from :attr:`HealthThresholds.critical_failures` on): the newest
  ended epochs failed or expired, with no completed one since.
* ``overdue`` (warning): the pipeline is running and no epoch has completed for longer than
  ``overdue_intervals`` checkpoint intervals plus ``overdue_grace_s``, counted from the newer of
  the last completed epoch's end and the pipeline's last state change (a new run starts the clock
  again).
* ``timed_out`` (warning): the in-flight epoch is past its timeout and nobody expired it yet (the
  trigger expires it at its next tick: is the triggerer running?).
* ``heartbeat`` (warning): a live pipeline (registered, running, stopping) whose driver has not
  sent a heartbeat for ``max(heartbeat_min_s, heartbeat_intervals x interval)``.
* ``cleanup`` (info): a cleanup run holds the cleanup lock now; no epoch starts until it ends.
* ``stopping`` (info): a stop was requested.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from airflow_arroyo.epochs import PipelineState
from airflow_arroyo.store.reads import PipelineOverview
from airflow_arroyo.ui.format import duration_human, timestamp

__all__ = ["Finding", "HealthThresholds", "Severity", "assess", "worst"]


class Severity(enum.IntEnum):
    OK = 0
    INFO = 1
    WARNING = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    kind: str
    severity: Severity
    message: str


@dataclass(frozen=True)
class HealthThresholds:
    overdue_intervals: float = 3.0
    overdue_grace_s: float = 60.0
    heartbeat_intervals: float = 3.0
    heartbeat_min_s: float = 120.0
    critical_failures: int = 3


_LIVE = (PipelineState.REGISTERED, PipelineState.RUNNING, PipelineState.STOPPING)


def assess(o: PipelineOverview, t: HealthThresholds = HealthThresholds()) -> list[Finding]:
    """The findings for one pipeline, most severe first."""
    p = o.pipeline
    now = o.now
    found: list[Finding] = []

    if p.state is PipelineState.FAILED:
        cause = f": {p.failure_cause}" if p.failure_cause else ""
        found.append(Finding("failed", Severity.CRITICAL, f"the pipeline run failed{cause}"))

    n = o.consecutive_failures
    if n:
        last = o.last_failure
        count = f"at least {n}" if o.failure_streak_capped else str(n)
        noun = "checkpoint" if n == 1 else "checkpoints"
        detail = ""
        if last is not None:
            detail = f"; epoch {last.epoch} {last.state.value}"
            if last.failure_reason:
                detail += f": {last.failure_reason}"
        severity = Severity.CRITICAL if n >= t.critical_failures else Severity.WARNING
        found.append(Finding("failing", severity, f"the last {count} {noun} failed{detail}"))

    interval = p.checkpoint_interval_s
    if p.state is PipelineState.RUNNING and interval:
        since_candidates = [d for d in (p.updated_at,) if d is not None]
        if o.last_completed is not None and o.last_completed.ended_at is not None:
            since_candidates.append(o.last_completed.ended_at)
        if since_candidates:
            since = max(since_candidates)
            waited = (now - since).total_seconds()
            limit = t.overdue_intervals * interval + t.overdue_grace_s
            if waited > limit:
                what = ("no checkpoint has completed in this run" if o.last_completed is None
                        or (p.updated_at is not None and o.last_completed.ended_at is not None
                            and o.last_completed.ended_at < p.updated_at)
                        else "no checkpoint has completed")
                found.append(Finding(
                    "overdue", Severity.WARNING,
                    f"checkpoints are overdue: {what} for {duration_human(waited)} "
                    f"(interval {duration_human(interval)})",
                ))

    if o.in_flight is not None and now >= o.in_flight.timeout_at:
        found.append(Finding(
            "timed_out", Severity.WARNING,
            f"epoch {o.in_flight.epoch} is past its timeout ({timestamp(o.in_flight.timeout_at)}) and still "
            "in flight; the checkpoint trigger expires it at its next tick: is the triggerer running?",
        ))

    if p.state in _LIVE:
        stale_after = max(t.heartbeat_min_s, t.heartbeat_intervals * (interval or 0.0))
        if p.heartbeat_at is None:
            found.append(Finding("heartbeat", Severity.WARNING, "the pipeline driver never sent a heartbeat"))
        else:
            silent = (now - p.heartbeat_at).total_seconds()
            if silent > stale_after:
                found.append(Finding(
                    "heartbeat", Severity.WARNING,
                    f"no heartbeat from the pipeline driver for {duration_human(silent)}: "
                    "is the Spark application still alive?",
                ))

    if o.cleanup_lock is not None:
        lock = o.cleanup_lock
        found.append(Finding(
            "cleanup", Severity.INFO,
            f"cleanup run {lock.cleanup_run} ({lock.holder}) holds the cleanup lock until "
            f"{timestamp(lock.expires_at)}; no checkpoint starts until it ends",
        ))

    if p.stop_requested and p.state in _LIVE:
        found.append(Finding("stopping", Severity.INFO, f"a {p.stop_requested} stop was requested"))

    found.sort(key=lambda f: -f.severity)
    return found


def worst(findings: list[Finding]) -> Severity:
    return max((f.severity for f in findings), default=Severity.OK)
