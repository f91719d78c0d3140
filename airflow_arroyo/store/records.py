"""Plain records read from the epoch store."""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, TriggerDecision

__all__ = [
    "EPOCH_COLUMNS",
    "AckOutcome",
    "AckRecord",
    "AckResult",
    "CleanupLockRecord",
    "CleanupRunRecord",
    "EpochRecord",
    "FencingToken",
    "PipelineRecord",
    "PrunePlan",
    "SinkCommitRecord",
    "SnapshotEntry",
    "TickReport",
    "TickRequest",
    "TickResult",
    "epoch_columns",
    "from_row",
]

R = TypeVar("R")

#: The columns of ``arroyo_epochs`` that make an :class:`EpochRecord`, in one place for every query.
EPOCH_COLUMNS = (
    "pipeline_id", "epoch", "state", "run_id", "stages", "is_final", "triggered_by", "triggered_at", "timeout_at",
    "ended_at", "failure_reason", "bytes_new", "bytes_total", "pruned_at", "bytes_freed", "self_contained",
    "outcome", "pin_label", "pinned_at", "unrestorable",
)


def epoch_columns(alias: str = "") -> str:
    """``EPOCH_COLUMNS`` as a select list, each qualified with ``alias`` when one is given."""
    prefix = f"{alias}." if alias else ""
    return ", ".join(prefix + c for c in EPOCH_COLUMNS)


def from_row(cls: type[R], row: Mapping[str, Any]) -> R:
    """A record of type ``cls`` from a row (columns it does not have are ignored)."""
    names = _field_names(cls)  # type: ignore[arg-type]
    return cls(**{k: v for k, v in row.items() if k in names})


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


@dataclass(frozen=True)
class PipelineRecord:
    """A row of ``arroyo_pipelines``: the pipeline's current run and state."""
    pipeline_id: str
    state: PipelineState
    run_id: str | None = None
    stages: list[str] = field(default_factory=list)
    channels: dict[str, str] = field(default_factory=dict)
    storage_uri: str | None = None
    checkpoint_interval_s: float | None = None
    spark_app_id: str | None = None
    spark_ui_url: str | None = None
    heartbeat_at: datetime | None = None
    failure_cause: str | None = None
    stop_requested: str | None = None
    restored_from_epoch: int | None = None
    last_epoch: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    updated_at: datetime | None = None
    generation: int = 0  # the fencing token of the current run (migration 0006): +1 at every registration
    # a fork (migration 0009): the pipeline and completed epoch it started from, and when it was forked
    forked_from_pipeline: str | None = None
    forked_from_epoch: int | None = None
    forked_at: datetime | None = None
    # supervision (migration 0011): what the supervisor of the lineage does, the lineage (first run id),
    # and the restart strategy as configured; see airflow_arroyo.core.supervision
    supervision: str | None = None
    supervised_run: str | None = None
    supervised_since: datetime | None = None
    restart_strategy: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", PipelineState(self.state))

    @property
    def token(self) -> FencingToken:
        """The current run's fencing token."""
        return FencingToken(self.pipeline_id, self.run_id or "", int(self.generation))


@dataclass(frozen=True)
class RestartRecord:
    """A row of ``arroyo_restarts``: one failure a supervisor noticed, and the restart after it."""
    pipeline_id: str
    lineage: str
    attempt: int
    failed_run_id: str
    cause: str
    failed_at: datetime
    delay_s: float = 0.0
    gave_up: bool = False
    decision: str | None = None
    new_run_id: str | None = None
    restored_epoch: int | None = None
    restarted_at: datetime | None = None
    supervised_since: datetime | None = None  # the supervision the failure belongs to


@dataclass(frozen=True)
class FencingToken:
    """What a run's writes carry so that they are refused once a newer run registered (Kafka's producer
    epoch, Flink's fencing token): the pipeline's ``generation``, which the store increments in the
    transaction that registers a run. A write whose generation is not the pipeline's current one is a
    write of a superseded run: the store refuses it in SQL, and storage readers ignore it (channels'
    fences, the sinks' commit points). Picklable: executors carry it."""

    pipeline_id: str
    run_id: str
    generation: int

    def __str__(self) -> str:
        return f"run {self.run_id!r} (generation {self.generation})"


@dataclass(frozen=True)
class EpochRecord:
    """A row of ``arroyo_epochs``."""
    pipeline_id: str
    epoch: int
    state: EpochState
    triggered_at: datetime
    timeout_at: datetime
    stages: list[str] = field(default_factory=list)
    run_id: str | None = None
    is_final: bool = False
    triggered_by: str | None = None
    ended_at: datetime | None = None
    failure_reason: str | None = None
    bytes_new: int | None = None
    bytes_total: int | None = None
    pruned_at: datetime | None = None
    bytes_freed: int | None = None
    self_contained: bool = False  # its snapshot shares no object with another epoch
    # how it ended (migration 0007): completed, failed, expired or superseded, kept through pruning; None
    # while in flight. Recorded by the database with the state: read it, never the text of failure_reason.
    outcome: EpochState | None = None
    # pinned (migration 0008): retention keeps it and what a restore of it needs; None when not pinned
    pin_label: str | None = None
    pinned_at: datetime | None = None
    # why a restore proved it can never be restored (migration 0012); None: no restore found a problem
    unrestorable: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", EpochState(self.state))
        if self.outcome is not None:
            object.__setattr__(self, "outcome", EpochState(self.outcome))

    @property
    def duration_s(self) -> float | None:
        """Seconds from trigger to end (None while in flight)."""
        if self.ended_at is None:
            return None
        return (self.ended_at - self.triggered_at).total_seconds()


@dataclass(frozen=True)
class AckRecord:
    """A stage's acknowledgement of an epoch (``arroyo_epoch_acks``)."""
    pipeline_id: str
    epoch: int
    stage: str
    acked_at: datetime
    cursors: dict[str, int] = field(default_factory=dict)
    alignment_ms: float | None = None
    sync_ms: float | None = None
    async_ms: float | None = None
    bytes_new: int | None = None
    bytes_total: int | None = None
    snapshot_uri: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


class AckOutcome(enum.Enum):
    """What a stage's acknowledgement did (Flink's ``TaskAcknowledgeResult``)."""

    ACCEPTED = "accepted"
    """Recorded; the epoch still waits for other stages."""
    COMPLETED_EPOCH = "completed the epoch"
    """Recorded, and it was the last one expected: the epoch is completed now."""
    DUPLICATE = "duplicate"
    """The stage had acknowledged this epoch already (whatever the epoch's state now): its first acknowledgement
    stays, nothing changed."""
    EPOCH_ENDED = "epoch already ended"
    """The epoch had already ended (expired, failed, superseded, ...): kept for the record, nothing changed."""


@dataclass(frozen=True)
class AckResult:
    """The answer to a stage's acknowledgement: what it did, and the epoch's state afterwards."""

    outcome: AckOutcome
    state: EpochState


@dataclass(frozen=True)
class SinkCommitRecord:
    """What one file sink made visible when epoch ``epoch`` committed (files of batches <= ``batch_id``)."""

    seq: int
    pipeline_id: str
    epoch: int
    sink: str
    uri: str
    run_id: str | None
    batch_id: int
    files: int
    rows_committed: int | None
    bytes_committed: int
    committed_at: datetime
    table_version: int | None = None  # the version a table sink's commit made (migration 0013)


@dataclass(frozen=True)
class CleanupLockRecord:
    """The cleanup lease of a pipeline (``arroyo_cleanup_locks``)."""
    pipeline_id: str
    cleanup_run: int
    holder: str
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class CleanupRunRecord:
    """One cleanup run (``arroyo_cleanup_runs``)."""
    id: int
    pipeline_id: str
    holder: str
    state: str
    started_at: datetime
    policy: dict[str, Any] = field(default_factory=dict)
    ended_at: datetime | None = None
    epochs_pruned: list[int] = field(default_factory=list)
    bytes_freed: int = 0
    error: str | None = None


@dataclass(frozen=True)
class SnapshotEntry:
    """One file of a stage's snapshot: ``rel_path`` inside the Spark checkpoint, stored as ``object_key``."""

    rel_path: str
    object_key: str
    bytes: int


@dataclass(frozen=True)
class TickResult:
    """What one trigger tick decided and did."""

    decision: TriggerDecision
    now: datetime
    pipeline_state: PipelineState
    started: EpochRecord | None = None
    expired: EpochRecord | None = None
    consecutive_failures: int = 0
    ended: tuple[EpochRecord, ...] = ()  # epochs of the tick's ``watch`` that are no longer in flight
    last_epoch: int | None = None  # the pipeline's newest epoch number after the tick (0: none yet)
    # this process's ``time.monotonic()`` when the database read ``now`` (the midpoint of that
    # statement's round trip): maps database instants to local timers without another round trip
    observed_at: float | None = None
    # what the controller reports about the epochs this tick saw, read with the batch (None: not read)
    report: TickReport | None = None


@dataclass(frozen=True)
class TickReport:
    """Read right after a batch of ticks committed, for the controller's log lines and metrics, so
    that a trigger needs no transaction of its own per epoch (``airflow_arroyo.store._batch``)."""

    heartbeat_at: datetime | None = None  # the driver's last heartbeat (read when an epoch ended in the tick)
    alignment_ms: Mapping[int, float] = field(default_factory=dict)  # completed ended epoch -> slowest stage's
    in_flight: EpochRecord | None = None  # the epoch in flight, when the tick did not watch it already


@dataclass(frozen=True)
class TickRequest:
    """One pipeline's tick in :meth:`~airflow_arroyo.store.EpochStore.trigger_ticks`.

    ``skip_if_locked``: if another transaction holds the pipeline's row lock, leave this pipeline out
    (its result is ``None``) instead of waiting for the lock, so one busy pipeline does not hold up a
    whole batch; ask again.
    """

    pipeline_id: str
    policy: CheckpointPolicy
    triggered_by: str = "trigger"
    force: bool = False
    is_final: bool = False
    watch: tuple[int, ...] = ()
    skip_if_locked: bool = False
    self_contained: bool = False  # a started epoch's snapshot copies every object (docs/runtime.md)


@dataclass(frozen=True)
class PrunePlan:
    """Epochs now marked ``pruning`` and what only they reference."""

    epochs: list[int]
    objects: list[tuple[str, int]]  # (object_key, bytes) referenced by no retained epoch
    channel_low_watermarks: dict[str, int]  # channel URI -> first position a retained epoch may need
    storage_uri: str | None


@dataclass(frozen=True)
class CompactionCut:
    """Where compaction cut a pipeline's history (``arroyo_history_base``): every event up to
    ``through_seq`` goes, with the epochs pruned before ``cut_at`` and the cleanup runs up to
    ``cleanup_run`` (the run whose lease release is the cut)."""

    through_seq: int
    max_epoch: int
    cut_at: datetime
    cleanup_run: int


@dataclass(frozen=True)
class ObjectRecord:
    """A snapshot object as the store knows it, with what the last scrub found (``verify_state`` ``None``:
    never verified; ``ok``, ``missing`` or ``corrupt``)."""

    object_key: str
    bytes: int
    verified_at: datetime | None = None
    verify_state: str | None = None
    verify_detail: str | None = None
    epochs: tuple[int, ...] = ()  # the retained epochs whose snapshot references it
