"""The model: life cycles of pipelines and epochs, and the pure decisions over them.

Nothing in this module does I/O. The store reads facts, hands them to these functions and writes
what they decide; the tests drive them exhaustively.

Epoch life cycle (one table, :data:`EPOCH_TRANSITIONS`)::

    triggered ──> completed ──> pruning ──> pruned
        │             │            ^
        │             └─> superseded ┤   (a restore of an older epoch abandoned it)
        ├──> failed ───────────────┤
        └──> expired ──────────────┘

Pipeline life cycle (:data:`PIPELINE_TRANSITIONS`)::

    registered ──> running ──> stopping ──> stopped ──> registered (a new run)
         │            │           │
         └────────────┴───────────┴──> failed ──> registered (a new run)

``registered`` and ``running`` may also go straight to ``stopped`` (an immediate stop, or one before ``running``).
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from airflow_arroyo.core.exceptions import ConfigurationError, IllegalTransitionError

__all__ = [
    "EPOCH_TRANSITIONS",
    "PIPELINE_TRANSITIONS",
    "CheckpointPolicy",
    "CleanupLease",
    "EpochFacts",
    "EpochState",
    "PipelineState",
    "RetentionPolicy",
    "TriggerAction",
    "TriggerDecision",
    "TriggerFacts",
    "check_epoch_transition",
    "check_pipeline_transition",
    "consecutive_failures",
    "decide_trigger",
    "select_prunable",
    "validate_pipeline_id",
]


class EpochState(enum.StrEnum):
    """The life cycle of an epoch; legal moves are in :data:`EPOCH_TRANSITIONS`."""
    TRIGGERED = "triggered"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    PRUNING = "pruning"
    PRUNED = "pruned"
    # completed, but a restore of an older epoch abandoned it: its snapshot no longer matches the channels
    SUPERSEDED = "superseded"

    @property
    def in_flight(self) -> bool:
        """True while the epoch is triggered and not yet ended."""
        return self is EpochState.TRIGGERED

    @property
    def ended_unsuccessfully(self) -> bool:
        """True for an epoch that failed or expired."""
        return self in (EpochState.FAILED, EpochState.EXPIRED)


class PipelineState(enum.StrEnum):
    """The life cycle of a pipeline run; legal moves are in :data:`PIPELINE_TRANSITIONS`."""
    REGISTERED = "registered"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        """True once the run stopped or failed (no move leaves these but a new registration)."""
        return self in (PipelineState.STOPPED, PipelineState.FAILED)


EPOCH_TRANSITIONS: dict[EpochState, frozenset[EpochState]] = {
    EpochState.TRIGGERED: frozenset({EpochState.COMPLETED, EpochState.FAILED, EpochState.EXPIRED}),
    EpochState.COMPLETED: frozenset({EpochState.PRUNING, EpochState.SUPERSEDED}),
    EpochState.SUPERSEDED: frozenset({EpochState.PRUNING}),
    EpochState.FAILED: frozenset({EpochState.PRUNING}),
    EpochState.EXPIRED: frozenset({EpochState.PRUNING}),
    EpochState.PRUNING: frozenset({EpochState.PRUNED}),
    EpochState.PRUNED: frozenset(),
}

PIPELINE_TRANSITIONS: dict[PipelineState, frozenset[PipelineState]] = {
    PipelineState.REGISTERED: frozenset({PipelineState.RUNNING, PipelineState.STOPPED, PipelineState.FAILED}),
    PipelineState.RUNNING: frozenset({PipelineState.STOPPING, PipelineState.STOPPED, PipelineState.FAILED}),
    PipelineState.STOPPING: frozenset({PipelineState.STOPPED, PipelineState.FAILED}),
    PipelineState.STOPPED: frozenset({PipelineState.REGISTERED}),
    PipelineState.FAILED: frozenset({PipelineState.REGISTERED}),
}


def epoch_states_from(target: EpochState) -> list[str]:
    """States from which ``target`` may be reached (used in guarded UPDATEs)."""
    return sorted(s.value for s, nxt in EPOCH_TRANSITIONS.items() if target in nxt)


def pipeline_states_from(target: PipelineState) -> list[str]:
    return sorted(s.value for s, nxt in PIPELINE_TRANSITIONS.items() if target in nxt)


def check_epoch_transition(current: EpochState, target: EpochState, *, subject: str = "") -> None:
    """Raise :class:`IllegalTransitionError` unless an epoch may move from ``current`` to ``target``."""
    if target not in EPOCH_TRANSITIONS[current]:
        raise IllegalTransitionError("epoch", current.value, target.value, subject=subject)


def check_pipeline_transition(current: PipelineState, target: PipelineState, *, subject: str = "") -> None:
    """Raise :class:`IllegalTransitionError` unless a pipeline may move from ``current`` to ``target``."""
    if target not in PIPELINE_TRANSITIONS[current]:
        raise IllegalTransitionError("pipeline", current.value, target.value, subject=subject)


_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def validate_pipeline_id(pipeline_id: str) -> str:
    """Pipeline ids name folders and URLs: 1-200 characters of ``[A-Za-z0-9_.-]``."""
    if not isinstance(pipeline_id, str) or not 1 <= len(pipeline_id) <= 200:
        raise ConfigurationError(
            f"pipeline id {pipeline_id!r} must be a string of 1 to 200 characters; "
            "use letters, digits, '_', '.' or '-'"
        )
    bad = sorted(set(pipeline_id) - _ID_CHARS)
    if bad or pipeline_id in (".", ".."):
        raise ConfigurationError(
            f"pipeline id {pipeline_id!r} has characters {''.join(bad)!r} that cannot name a folder "
            "or a URL; use letters, digits, '_', '.' or '-'"
        )
    return pipeline_id


# --------------------------------------------------------------------------- checkpoint policy


@dataclass(frozen=True)
class CheckpointPolicy:
    """When checkpoints start and how failures are tolerated (all durations in seconds).

    * ``interval``: the period of the checkpoint schedule (Flink's checkpoint interval): epochs are due
      on a fixed-rate grid, one every ``interval`` at a phase of the pipeline's own (:func:`next_start_at`).
    * ``timeout``: an epoch still in flight this long after its trigger is ``expired``.
      Must be at least ``interval``: otherwise every slow epoch expires before the next is due.
    * ``min_pause``: at least this long between the end of one epoch and the start of the next.
    * ``tolerable_failures``: consecutive failed/expired epochs tolerated; one more ends the trigger
      with a failure event.
    * ``heartbeat_timeout``: a running pipeline whose driver has not heartbeated for this long is not
      alive: no epoch starts for it (it could only expire). The driver heartbeats every 2 s and a new
      run takes over one silent for 30 s; ``None`` starts epochs whatever the heartbeat says.
    """

    interval: float
    timeout: float | None = None
    min_pause: float = 0.0
    tolerable_failures: int = 3
    heartbeat_timeout: float | None = 30.0

    def __post_init__(self) -> None:
        if not _finite(self.interval) or self.interval <= 0:
            raise ConfigurationError(
                f"checkpoint interval must be a positive number of seconds, got {self.interval!r}; "
                "e.g. interval=30"
            )
        timeout = self.effective_timeout
        if not _finite(timeout) or timeout < self.interval:
            raise ConfigurationError(
                f"checkpoint timeout ({timeout!r}s) is shorter than the interval ({self.interval}s); "
                "every slow epoch would expire before the next is due: use a timeout >= the interval"
            )
        if not _finite(self.min_pause) or self.min_pause < 0:
            raise ConfigurationError(
                f"min_pause must be zero or a positive number of seconds, got {self.min_pause!r}"
            )
        if not isinstance(self.tolerable_failures, int) or self.tolerable_failures < 0:
            raise ConfigurationError(
                f"tolerable_failures must be a whole number >= 0, got {self.tolerable_failures!r}"
            )
        if self.heartbeat_timeout is not None and (not _finite(self.heartbeat_timeout) or self.heartbeat_timeout <= 0):
            raise ConfigurationError(
                f"heartbeat_timeout must be a positive number of seconds (or None), got {self.heartbeat_timeout!r}"
            )

    @property
    def effective_timeout(self) -> float:
        """The timeout, defaulting to ten intervals (at least 60 s)."""
        return self.timeout if self.timeout is not None else max(10 * self.interval, 60.0)


def _finite(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class CleanupLease:
    """A live cleanup lease: who holds it and until when (database time)."""
    holder: str
    expires_at: datetime


@dataclass(frozen=True)
class TriggerFacts:
    """What the trigger knows about one pipeline at ``now`` (read in one transaction)."""

    now: datetime
    pipeline_state: PipelineState
    last_epoch: int  # highest epoch number ever used, 0 if none
    in_flight_epoch: int | None = None
    in_flight_timeout_at: datetime | None = None
    last_triggered_at: datetime | None = None  # start of the newest epoch, any state
    last_ended_at: datetime | None = None  # end of the newest ended epoch (completed/failed/expired)
    cleanup_lease: CleanupLease | None = None  # an unexpired lease, if any
    stop_requested: bool = False
    heartbeat_at: datetime | None = None  # the driver's last heartbeat (None: never heartbeated)
    # asked for now, not by the schedule (a manual checkpoint, a graceful stop's final epoch): the schedule
    # does not apply and a stopping pipeline counts as running; the other rules all still do
    force: bool = False
    # the final epoch of a graceful stop, asked for by the stopping driver: its own stop request does
    # not hold it back
    final_epoch: bool = False
    pipeline_id: str = ""  # places the pipeline's schedule in the interval (schedule_phase)


class TriggerAction(enum.StrEnum):
    """What :func:`decide_trigger` tells the controller to do."""
    START = "start"  # insert epoch ``epoch`` as triggered
    EXPIRE = "expire"  # mark in-flight ``epoch`` expired
    WAIT_IN_FLIGHT = "wait_in_flight"
    WAIT_CLEANUP = "wait_cleanup"
    WAIT_SCHEDULE = "wait_schedule"
    PIPELINE_NOT_RUNNING = "pipeline_not_running"
    PIPELINE_NOT_ALIVE = "pipeline_not_alive"  # running, but its driver's heartbeat is stale
    PIPELINE_ENDED = "pipeline_ended"


@dataclass(frozen=True)
class TriggerDecision:
    """The answer of :func:`decide_trigger`: the action, its epoch, and when to ask again."""
    action: TriggerAction
    epoch: int | None = None
    # when the next decision is worth making (None: as soon as convenient)
    recheck_at: datetime | None = None
    reason: str = ""


def decide_trigger(facts: TriggerFacts, policy: CheckpointPolicy) -> TriggerDecision:
    """Should a checkpoint epoch start now? The whole rule, in one place.

    Order matters: an in-flight epoch past its timeout is expired first (so it stops blocking);
    then a pipeline that ended ends the trigger; then the one-in-flight rule; then a pipeline that is
    not running, or was asked to stop, gets no epoch; then liveness (a running pipeline whose
    heartbeat is older than ``policy.heartbeat_timeout`` gets no epoch: it would only expire); then
    the cleanup lock; then the schedule (the fixed-rate grid's next point after the last start, min pause since
    the last end: :func:`next_start_at`).

    ``facts.force`` skips the schedule and lets a ``stopping`` pipeline count as running;
    ``facts.final_epoch`` lets the stop request through (a graceful stop's final epoch). Neither
    overrides the in-flight epoch, a pipeline that ended, liveness or the cleanup lock.
    """
    now = facts.now
    if facts.in_flight_epoch is not None:
        if facts.in_flight_timeout_at is not None and now >= facts.in_flight_timeout_at:
            return TriggerDecision(TriggerAction.EXPIRE, epoch=facts.in_flight_epoch,
                                   reason=f"epoch {facts.in_flight_epoch} passed its timeout")
        return TriggerDecision(TriggerAction.WAIT_IN_FLIGHT, epoch=facts.in_flight_epoch,
                               recheck_at=facts.in_flight_timeout_at,
                               reason=f"epoch {facts.in_flight_epoch} is in flight")
    if facts.pipeline_state.terminal:
        return TriggerDecision(TriggerAction.PIPELINE_ENDED, reason=f"pipeline is {facts.pipeline_state}")
    running = facts.pipeline_state is PipelineState.RUNNING or (
        facts.force and facts.pipeline_state is PipelineState.STOPPING)
    if not running or (facts.stop_requested and not facts.final_epoch):
        return TriggerDecision(TriggerAction.PIPELINE_NOT_RUNNING, recheck_at=now + timedelta(seconds=1),
                               reason=f"pipeline is {facts.pipeline_state}")
    if policy.heartbeat_timeout is not None and facts.heartbeat_at is not None:
        age = (now - facts.heartbeat_at).total_seconds()
        if age > policy.heartbeat_timeout:
            return TriggerDecision(
                TriggerAction.PIPELINE_NOT_ALIVE, recheck_at=now + timedelta(seconds=1),
                reason=f"the driver's last heartbeat is {age:.0f}s old (more than {policy.heartbeat_timeout:g}s): "
                       "it is not alive; no epoch until it heartbeats again or a new run registers",
            )
    if facts.cleanup_lease is not None and facts.cleanup_lease.expires_at > now:
        return TriggerDecision(TriggerAction.WAIT_CLEANUP, recheck_at=facts.cleanup_lease.expires_at,
                               reason=f"cleanup lock held by {facts.cleanup_lease.holder}")
    due = None if facts.force else next_start_at(facts, policy)
    if due is not None and now < due:
        return TriggerDecision(TriggerAction.WAIT_SCHEDULE, recheck_at=due, reason="not due yet")
    return TriggerDecision(TriggerAction.START, epoch=facts.last_epoch + 1, reason="due")


def next_start_at(facts: TriggerFacts, policy: CheckpointPolicy) -> datetime | None:
    """Earliest start of the next epoch: the schedule's next point after the last start, and the min pause
    after the last end.

    The schedule is a **fixed-rate** grid, as Flink's periodic checkpoint scheduler (``scheduleAtFixedRate``
    after a random initial delay): the points ``phase + k * interval`` (seconds since 1970, UTC), where the
    phase is the pipeline's own (:func:`schedule_phase`). The next epoch is due at the first point after the
    last start. An epoch started late does not push the schedule back (lateness does not add up from epoch to
    epoch), an epoch that started a whole interval late or more is followed at the next point (no burst
    catches up on missed points), and pipelines are spread over the interval instead of all being due at once.
    """
    candidates: list[datetime] = []
    if facts.last_triggered_at is not None:
        candidates.append(due_after_start(facts.pipeline_id, facts.last_triggered_at, policy))
    if facts.last_ended_at is not None and policy.min_pause > 0:
        candidates.append(facts.last_ended_at + timedelta(seconds=policy.min_pause))
    return max(candidates) if candidates else None


def due_after_start(pipeline_id: str, started: datetime, policy: CheckpointPolicy) -> datetime:
    """When the schedule has the next epoch due after one started at ``started`` (min pause aside): the
    first point of the pipeline's fixed-rate grid after it. The trigger sleeps until then."""
    return schedule_point_after(started, policy.interval, schedule_phase(pipeline_id, policy.interval))


def schedule_phase(pipeline_id: str, interval: float) -> float:
    """Where in each interval the pipeline's epochs are due, in ``[0, interval)`` seconds: a fixed share of the
    interval drawn from a hash of the pipeline id (the same in every triggerer, run and restart; Flink draws a
    random initial delay per job for the same reason: many jobs' checkpoints do not all fall at once)."""
    share = int.from_bytes(hashlib.sha256(pipeline_id.encode()).digest()[:8], "big") / 2.0**64
    return share * interval


def schedule_point_after(t: datetime, interval: float, phase: float) -> datetime:
    """The first point of the grid ``phase + k * interval`` (seconds since 1970, UTC) strictly after ``t``."""
    origin = datetime(1970, 1, 1, tzinfo=UTC if t.tzinfo is not None else None)
    elapsed = (t - origin) // timedelta(microseconds=1)  # exact, in microseconds
    phase_us, interval_us = phase * 1e6, interval * 1e6
    k = math.floor((elapsed - phase_us) / interval_us) + 1
    due = math.ceil(phase_us + k * interval_us)  # rounded up: never before the point itself
    while due <= elapsed:  # float rounding right at a point
        k += 1
        due = math.ceil(phase_us + k * interval_us)
    return origin + timedelta(microseconds=due)


def consecutive_failures(states_newest_first: Iterable[EpochState]) -> int:
    """Failed or expired epochs since the newest completed one (in-flight epochs are skipped)."""
    n = 0
    for state in states_newest_first:
        if state is EpochState.TRIGGERED:
            continue
        if state.ended_unsuccessfully:
            n += 1
            continue
        if state is EpochState.COMPLETED:
            break
        # pruning/pruned epochs keep their history: a pruned epoch was pruned, not failed
        break
    return n


# --------------------------------------------------------------------------- retention


@dataclass(frozen=True)
class RetentionPolicy:
    """Which epochs to keep: the last ``keep_last`` completed ones and/or those newer than
    ``keep_newer_than``. An epoch is kept when either rule keeps it. The latest completed epoch, pinned
    epochs and any in-flight epoch are never pruned; failed and expired epochs are always pruned."""

    keep_last: int | None = None
    keep_newer_than: timedelta | None = None

    def __post_init__(self) -> None:
        if self.keep_last is None and self.keep_newer_than is None:
            raise ConfigurationError(
                "retention policy keeps nothing: give keep_last (e.g. 5) and/or keep_newer_than "
                "(a duration, e.g. '1h' or 3600 seconds)"
            )
        if self.keep_last is not None and (
            not isinstance(self.keep_last, int) or isinstance(self.keep_last, bool) or self.keep_last < 1
        ):
            raise ConfigurationError(
                f"keep_last must be a whole number >= 1, got {self.keep_last!r}: "
                "a retention that keeps no completed epoch leaves nothing to restore from"
            )
        if self.keep_newer_than is not None and (
            not isinstance(self.keep_newer_than, timedelta) or self.keep_newer_than <= timedelta(0)
        ):
            raise ConfigurationError(
                "keep_newer_than must be a positive duration (e.g. '1h' or 3600 seconds), got "
                + (f"{self.keep_newer_than.total_seconds():g} seconds" if isinstance(self.keep_newer_than, timedelta)
                   else repr(self.keep_newer_than))
            )


@dataclass(frozen=True)
class EpochFacts:
    """What :func:`select_prunable` needs of one epoch."""
    epoch: int
    state: EpochState
    triggered_at: datetime
    ended_at: datetime | None = None
    pin_label: str | None = None  # pinned: kept whatever the policy says


@dataclass(frozen=True)
class PruneSelection:
    prune: tuple[int, ...]
    keep: tuple[int, ...]
    reasons: dict[int, str] = field(default_factory=dict)


def select_prunable(epochs: Sequence[EpochFacts], policy: RetentionPolicy, now: datetime) -> PruneSelection:
    """Which epochs may be pruned under ``policy`` at ``now``. Pure and total.

    Epochs already ``pruning`` (a crashed cleanup's leftovers) are selected again so that a later
    run finishes them; ``pruned`` ones are neither kept nor selected. A pinned epoch (``pin_label``)
    is kept whatever the policy says (the store pins completed epochs only).
    """
    completed = sorted((e for e in epochs if e.state is EpochState.COMPLETED), key=lambda e: e.epoch)
    latest_completed = completed[-1].epoch if completed else None
    keep_by_count: set[int] = set()
    if policy.keep_last is not None:
        keep_by_count = {e.epoch for e in completed[-policy.keep_last:]}
    prune: list[int] = []
    keep: list[int] = []
    reasons: dict[int, str] = {}
    for e in sorted(epochs, key=lambda e: e.epoch):
        if e.state is EpochState.PRUNED:
            continue
        if e.state is EpochState.TRIGGERED:
            keep.append(e.epoch)
            reasons[e.epoch] = "in flight"
        elif e.state is EpochState.PRUNING:
            prune.append(e.epoch)
            reasons[e.epoch] = "unfinished pruning"
        elif e.pin_label is not None:
            keep.append(e.epoch)
            reasons[e.epoch] = f"pinned: {e.pin_label}"
        elif e.state.ended_unsuccessfully:
            prune.append(e.epoch)
            reasons[e.epoch] = f"{e.state.value}: partial data only"
        elif e.state is EpochState.SUPERSEDED:
            prune.append(e.epoch)
            reasons[e.epoch] = "superseded: a restore of an older epoch abandoned it"
        elif e.epoch == latest_completed:
            keep.append(e.epoch)
            reasons[e.epoch] = "latest completed"
        elif e.epoch in keep_by_count:
            keep.append(e.epoch)
            reasons[e.epoch] = f"among the last {policy.keep_last} completed"
        elif policy.keep_newer_than is not None and now - (e.ended_at or e.triggered_at) < policy.keep_newer_than:
            keep.append(e.epoch)
            reasons[e.epoch] = f"newer than {policy.keep_newer_than}"
        else:
            prune.append(e.epoch)
            reasons[e.epoch] = "outside the retention policy"
    return PruneSelection(prune=tuple(prune), keep=tuple(keep), reasons=reasons)
