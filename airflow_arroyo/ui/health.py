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
from collections.abc import Callable
from dataclasses import dataclass

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.store.reads import PipelineOverview
from airflow_arroyo.ui.format import duration_human, timestamp

__all__ = ["Finding", "HealthThresholds", "Severity", "assess", "worst"]


class Severity(enum.IntEnum):
    """How bad a finding is."""
    OK = 0
    INFO = 1
    WARNING = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        """The severity's name in lower case (for CSS classes and JSON)."""
        return self.name.lower()


@dataclass(frozen=True)
class Finding:
    """One warning about a pipeline."""
    kind: str
    severity: Severity
    message: str


@dataclass(frozen=True)
class HealthThresholds:
    """When the rules above warn."""
    overdue_intervals: float = 3.0
    overdue_grace_s: float = 60.0
    heartbeat_intervals: float = 3.0
    heartbeat_min_s: float = 120.0
    critical_failures: int = 3


_LIVE = (PipelineState.REGISTERED, PipelineState.RUNNING, PipelineState.STOPPING)


def assess(overview: PipelineOverview, thresholds: HealthThresholds = HealthThresholds()) -> list[Finding]:
    """The findings for one pipeline, most severe first (one rule per ``_rule`` below, in the module's order)."""
    found = [f for rule in _RULES if (f := rule(overview, thresholds)) is not None]
    found.sort(key=lambda f: -f.severity)
    return found


def _failed(overview: PipelineOverview, _: HealthThresholds) -> Finding | None:
    p = overview.pipeline
    if p.state is not PipelineState.FAILED:
        return None
    cause = f": {p.failure_cause}" if p.failure_cause else ""
    return Finding("failed", Severity.CRITICAL, f"the pipeline run failed{cause}")


def _failing(overview: PipelineOverview, thresholds: HealthThresholds) -> Finding | None:
    n = overview.consecutive_failures
    if not n:
        return None
    last = overview.last_failure
    count = f"at least {n}" if overview.failure_streak_capped else str(n)
    noun = "checkpoint" if n == 1 else "checkpoints"
    detail = ""
    if last is not None:
        detail = f"; epoch {last.epoch} {last.state.value}"
        if last.failure_reason:
            detail += f": {last.failure_reason}"
    severity = Severity.CRITICAL if n >= thresholds.critical_failures else Severity.WARNING
    return Finding("failing", severity, f"the last {count} {noun} failed{detail}")


def _overdue(overview: PipelineOverview, thresholds: HealthThresholds) -> Finding | None:
    p = overview.pipeline
    interval = p.checkpoint_interval_s
    if p.state is not PipelineState.RUNNING or not interval:
        return None
    last = overview.last_completed
    since_candidates = [d for d in (p.updated_at,) if d is not None]
    if last is not None and last.ended_at is not None:
        since_candidates.append(last.ended_at)
    if not since_candidates:
        return None
    waited = (overview.now - max(since_candidates)).total_seconds()
    if waited <= thresholds.overdue_intervals * interval + thresholds.overdue_grace_s:
        return None
    this_run = last is None or (p.updated_at is not None and last.ended_at is not None
                                and last.ended_at < p.updated_at)
    what = "no checkpoint has completed in this run" if this_run else "no checkpoint has completed"
    return Finding("overdue", Severity.WARNING,
                   f"checkpoints are overdue: {what} for {duration_human(waited)} "
                   f"(interval {duration_human(interval)})")


def _timed_out(overview: PipelineOverview, _: HealthThresholds) -> Finding | None:
    in_flight = overview.in_flight
    if in_flight is None or overview.now < in_flight.timeout_at:
        return None
    return Finding(
        "timed_out", Severity.WARNING,
        f"epoch {in_flight.epoch} is past its timeout ({timestamp(in_flight.timeout_at)}) and still "
        "in flight; the checkpoint trigger expires it at its next tick: is the triggerer running?",
    )


def _heartbeat(overview: PipelineOverview, thresholds: HealthThresholds) -> Finding | None:
    p = overview.pipeline
    if p.state not in _LIVE:
        return None
    if p.heartbeat_at is None:
        return Finding("heartbeat", Severity.WARNING, "the pipeline driver never sent a heartbeat")
    stale_after = max(thresholds.heartbeat_min_s, thresholds.heartbeat_intervals * (p.checkpoint_interval_s or 0.0))
    silent = (overview.now - p.heartbeat_at).total_seconds()
    if silent <= stale_after:
        return None
    return Finding("heartbeat", Severity.WARNING,
                   f"no heartbeat from the pipeline driver for {duration_human(silent)}: "
                   "is the Spark application still alive?")


def _cleanup(overview: PipelineOverview, _: HealthThresholds) -> Finding | None:
    lock = overview.cleanup_lock
    if lock is None:
        return None
    return Finding("cleanup", Severity.INFO,
                   f"cleanup run {lock.cleanup_run} ({lock.holder}) holds the cleanup lock until "
                   f"{timestamp(lock.expires_at)}; no checkpoint starts until it ends")


def _stopping(overview: PipelineOverview, _: HealthThresholds) -> Finding | None:
    p = overview.pipeline
    if not p.stop_requested or p.state not in _LIVE:
        return None
    return Finding("stopping", Severity.INFO, f"a {p.stop_requested} stop was requested")


def _fork_point_gone(overview: PipelineOverview, _: HealthThresholds) -> Finding | None:
    """A fork that has not completed an epoch of its own starts from its fork point: pruned, it cannot start."""
    p = overview.pipeline
    if p.forked_from_pipeline is None or p.forked_from_epoch is None or overview.last_completed is not None:
        return None
    point = overview.fork_point
    if point is not None and point.state not in (EpochState.PRUNING, EpochState.PRUNED):
        return None
    return Finding("fork_point", Severity.CRITICAL,
                   f"its fork point, epoch {p.forked_from_epoch} of {p.forked_from_pipeline}, was pruned: this fork "
                   "cannot start; fork again from a completed epoch (airflow-arroyo fork)")


_RULES: tuple[Callable[[PipelineOverview, HealthThresholds], Finding | None], ...] = (
    _failed, _failing, _overdue, _timed_out, _heartbeat, _cleanup, _stopping, _fork_point_gone)


def worst(findings: list[Finding]) -> Severity:
    """The most severe of ``findings`` (OK for none)."""
    return max((f.severity for f in findings), default=Severity.OK)
