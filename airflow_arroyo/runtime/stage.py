"""The stage runner: one Structured Streaming query per stage, and its part of every epoch.

Each stage's writer is a ``foreachBatch`` function running in the driver process, so that the
runner sees every micro-batch boundary. For micro-batch *b* it:

1. appends the batch's rows to the stage's output channel (idempotent per batch id), or hands them
   to the sink (an exactly-once sink pre-commits them; see :mod:`~airflow_arroyo.runtime.sinks`);
2. under the stage's lock, decides with :mod:`~airflow_arroyo.runtime.alignment` whether *b* is the
   cut of a pending epoch: a **source** stage cuts when the driver told it an epoch is pending; a
   **channel** stage reads ``offsets/b`` of its checkpoint (the end position of the batch on each
   input) and cuts when every aligned input ended right after barrier *n*; inputs that delivered
   *n* early are **capped** there through the stage's ``caps.json`` (read by the channel readers
   when they plan the next batch);
3. on a cut: appends barrier *n* to the output channel right after the batch's data, lifts the caps
   and schedules the **asynchronous snapshot** of "checkpoint as of batch b"; the snapshot thread
   waits for Spark's ``commits/b``, copies what is new and acknowledges the epoch with cursors and
   figures. Later batches run meanwhile.

A source stage with no new input runs no batch; the driver's poller then cuts it at its last
completed batch (:meth:`StageRunner.poll`), under the same lock, so its barrier still lands after
that batch's data and before the next one's.

Where the stage's checkpoint, caps and channels live is :mod:`~airflow_arroyo.runtime.layout`'s
business (:class:`~airflow_arroyo.runtime.layout.StorageLayout`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConfigurationError,
    FencedError,
    SnapshotError,
    UnknownEpochError,
)
from airflow_arroyo.runtime.alignment import (
    AlignmentAction,
    AlignmentDecision,
    InputEnd,
    decide_alignment,
    feedback_returned,
    source_cut,
    unaligned_cut,
)
from airflow_arroyo.runtime.channel import Channel, ChannelError, EntryKind
from airflow_arroyo.runtime.inputs import read_stage_input
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import STATE_STORES, StageKind, StageSpec
from airflow_arroyo.runtime.snapshot import SnapshotStore
from airflow_arroyo.runtime.sources import write_caps
from airflow_arroyo.runtime.spark_checkpoint import (
    CHECKPOINT_FILE_MANAGER_CONF,
    checkpoint_file_manager,
    checkpoint_offsets,
    latest_commit,
    state_bytes,
)
from airflow_arroyo.store import EpochRecord, EpochStore, FencingToken

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

    from airflow_arroyo.runtime.sinks.base import TransactionalSink

__all__ = ["CUTS_KEPT", "DEFAULT_CHANNEL_TRIGGER_INTERVAL", "DEFAULT_TRIGGER_INTERVAL", "CutRecord", "StageRunner",
           "brief_java_error", "trigger_interval"]

log = logging.getLogger(__name__)

# Seconds between micro-batch starts when a stage sets none (docs/runtime.md, "CPU per row at a steady rate").
# A query reading Spark sources: most of a small batch's cost is per batch, so a short cadence buys its rows'
# latency with CPU, and an epoch's cut never waits for it (a source cuts at its last completed batch).
DEFAULT_TRIGGER_INTERVAL = 0.5
# A query reading channels: its cadence is also how long each hop holds its rows and an epoch's barrier.
DEFAULT_CHANNEL_TRIGGER_INTERVAL = 0.1


def trigger_interval(spec: StageSpec) -> float:
    """The seconds between the micro-batch starts of ``spec``'s query."""
    if spec.trigger_interval is not None:
        return spec.trigger_interval
    return DEFAULT_TRIGGER_INTERVAL if spec.kind is StageKind.SOURCE else DEFAULT_CHANNEL_TRIGGER_INTERVAL


# --------------------------------------------------------------------------- the runner


#: the cuts a stage keeps in memory (:attr:`StageRunner.cuts`), newest last: one a stage per epoch would grow for
#: as long as the run lasts
CUTS_KEPT = 256


@dataclass(frozen=True)
class CutRecord:
    """What a stage did at one cut (the newest :data:`CUTS_KEPT` kept, for tests and logs)."""

    epoch: int
    batch_id: int
    cursors: Mapping[str, int]
    alignment_ms: float
    sync_ms: float
    output_barrier: int | None  # index of the barrier in the output channel
    at: float = field(default_factory=time.time)
    unaligned: bool = False  # cut before its barrier reached every input (alignment_timeout)


@dataclass
class _Pending:
    """A feedback-deferred ack of an iteration head (FLIP-16)."""

    epoch: int
    batch_id: int
    cursors: dict[str, int]
    alignment_ms: float
    sync_ms: float
    snapshot: Any = None  # Future of the snapshot
    unaligned: bool = False


class StageRunner:
    """Runs one stage of a pipeline: its query, its writer and its part of every epoch."""

    #: a query resuming from its checkpoint (a restore) reads its aligned channels with ``warm_up``: one batch of no
    #: rows while the queries start, so that it pays its first batch (state store, Python workers, planning) then and
    #: not after the stage before it writes; false only to measure a restore without it (benchmarks/state_scale.py)
    warm_resumed_inputs = True

    def __init__(
        self,
        spec: StageSpec,
        *,
        layout: StorageLayout,
        store: EpochStore,
        snapshots: SnapshotStore,
        executor: Executor,
        last_cut_epoch: int = 0,
        commit_timeout: float = 300.0,
        gated: bool = False,
        sink: TransactionalSink | None = None,
        token: FencingToken | None = None,
        channel_starts: Mapping[str, int] | None = None,
        alignment_timeout: float | None = None,
    ) -> None:
        self.spec = spec
        # a channel stage cuts unaligned once an epoch waited this long for its barriers (None: always aligned)
        self.alignment_timeout = alignment_timeout
        # a stage new in an upgrade (empty checkpoint): where each input channel starts, right after the restored
        # epoch's barrier (a restored stage's checkpoint says where it resumes)
        self.channel_starts = dict(channel_starts or {})
        # the run's fencing token: on every channel entry, caps file, acknowledgement and epoch failure
        self.token = token
        generation = token.generation if token is not None else 0
        self.sink = sink  # an exactly-once sink (files, PostgreSQL) this stage pre-commits to
        self.name = spec.name
        self.kind = spec.kind
        self.layout = layout
        self.store = store
        self.snapshots = snapshots
        self.executor = executor
        self.pipeline_id = layout.pipeline_id
        self.commit_timeout = commit_timeout
        self.checkpoint = layout.checkpoint(spec.name)
        self.checkpoint_uri = layout.checkpoint_uri(spec.name)  # for Spark's checkpointLocation
        self._checkpoint_fs = layout.checkpoint_fs.child(self.checkpoint)  # read every batch: resolved once
        self.caps_uri = layout.caps_uri(spec.name, generation)
        self._caps_path = layout.caps(spec.name, generation)
        self.output: Channel | None = None
        self.inputs: dict[str, Channel] = {}
        self.query: StreamingQuery | None = None
        self.cuts: deque[CutRecord] = deque(maxlen=CUTS_KEPT)  # the newest: a run may last months
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._pending: set[int] = set()  # source stages: epochs to inject
        self._last_cut_epoch = last_cut_epoch
        self._last_completed = -1  # last batch whose output is in the channel
        self._caps: dict[str, int] = {}
        self._aligning_since: dict[int, float] = {}
        self._uncut: dict[int, float] = {}  # channel stages with alignment_timeout: epoch -> when it was requested
        self._uncut_lock = threading.Lock()  # not the stage lock: a running batch holds that, the driver must not wait
        self._last_ends: tuple[int, dict[str, int]] | None = None  # channel stages: (batch, its end on each input)
        self._deferred: list[_Pending] = []  # iteration head: acks waiting for the barrier to come back
        self._feedback_ends: dict[str, int] = {}
        # The driver starts the queries one by one and holds their first micro-batch at this gate until all
        # are up, so that starting a query does not compete for CPU with the others' processing.
        self._gate = threading.Event()
        if not gated:
            self._gate.set()
        self.batch_started = threading.Event()
        # a micro-batch of this run's query completed (not of the checkpoint's: a restored stage has committed
        # batches before its query ever ran one, while its first micro-batch still pays for its state store,
        # Python workers and code generation)
        self._ran_batch = False
        self._closing = False
        # Flow control: how far each input has been read (end of the last micro-batch), and a bound on
        # this stage's own unread output (set by the driver; see set_backpressure).
        self.consumed: dict[str, int] = {}
        self._backlog: Callable[[], int] | None = None
        self._max_backlog = 0

    def __repr__(self) -> str:
        return f"StageRunner({self.pipeline_id}/{self.name}, {self.kind.value})"

    # ------------------------------------------------------------------ build and start

    @property
    def last_cut_epoch(self) -> int:
        """The newest epoch this stage cut."""
        return self._last_cut_epoch

    def caps(self) -> dict[str, int]:
        """The caps currently written for this stage's inputs."""
        with self._lock:
            return dict(self._caps)

    def build(self, spark: SparkSession) -> DataFrame:
        """The stage's output DataFrame (inputs are read from their channels, which must exist)."""
        spec = self.spec
        if spec.kind is StageKind.SOURCE:
            assert spec.fn is not None
            df = spec.fn(spark)
        else:
            frames = []
            resumed = self.warm_resumed_inputs and latest_commit(self.layout.checkpoint_fs, self.checkpoint) >= 0
            for channel in spec.all_inputs:
                uri = self.layout.channel_uri(channel)  # what the executors' reader opens
                self.inputs[channel] = Channel.open(self.layout.channel_fs(channel))
                frames.append(read_stage_input(
                    spark, uri, key=channel, cap_path=self.caps_uri, stop_at_barriers=channel not in spec.feedback,
                    start_pos=self.channel_starts.get(channel),
                    warm_up=resumed and channel not in spec.feedback,
                ))
                # a restored reader resumes right after barrier N, where the restore cut the channel
                self.consumed[channel] = self.inputs[channel].end_position()
            df = spec.fn(*frames) if spec.fn is not None else frames[0]
        from pyspark.sql import DataFrame as SparkDataFrame

        if not isinstance(df, SparkDataFrame) or not df.isStreaming:
            what = "read(spark)" if spec.kind is StageKind.SOURCE else "transform(*inputs)"
            raise ConfigurationError(
                f"stage {spec.name!r}: {what} must return a streaming DataFrame (spark.readStream... or a "
                f"transformation of the inputs), got {type(df).__name__}"
                + ("" if not isinstance(df, SparkDataFrame) else " that is not streaming")
            )
        if spec.output is not None:
            self.output = Channel.create(self.layout.channel_fs(spec.output), schema=df.schema)
            self.output.token = self.token
        return df

    def start(self, spark: SparkSession, df: DataFrame) -> StreamingQuery:
        """Start the stage's query (per-stage SQL confs apply to this query only)."""
        self.batch_started.clear()
        self._ran_batch = False
        self._last_completed = latest_commit(self.layout.checkpoint_fs, self.checkpoint)
        self._write_caps({})
        spec = self.spec
        confs = dict(spec.spark_conf)
        if spec.state_store is not None:
            confs["spark.sql.streaming.stateStore.providerClass"] = STATE_STORES[spec.state_store]
        if CHECKPOINT_FILE_MANAGER_CONF not in confs and spark.conf.get(CHECKPOINT_FILE_MANAGER_CONF, None) is None:
            # on a local disk Spark's FileSystem-based writer, which starts 2 processes per file where the default
            # starts 10, none on the provider's file: file system (airflow_arroyo.jvm); on S3 a writer of the final
            # object, no temporary object copied (spark_checkpoint.checkpoint_file_manager); a manager the session
            # or the stage names wins
            manager = checkpoint_file_manager(spark, self.layout.checkpoint_fs)
            if manager is not None:
                confs[CHECKPOINT_FILE_MANAGER_CONF] = manager
        previous = {k: spark.conf.get(k, None) for k in confs}
        try:
            for k, v in confs.items():
                spark.conf.set(k, v)
            writer = (df.writeStream.queryName(f"{self.pipeline_id}.{self.name}")
                      .outputMode(spec.output_mode).foreachBatch(self._foreach_batch)
                      .option("checkpointLocation", self.checkpoint_uri))
            interval = trigger_interval(spec)
            if interval > 0:
                writer = writer.trigger(processingTime=f"{int(interval * 1000)} milliseconds")
            self.query = writer.start()
        finally:
            for k, old in previous.items():
                if old is None:
                    spark.conf.unset(k)
                else:
                    spark.conf.set(k, old)
        log.info("pipeline=%s stage=%s: query started (last committed batch %s, last cut epoch %s)",
                 self.pipeline_id, self.name, self._last_completed, self._last_cut_epoch)
        return self.query

    def alive(self) -> bool:
        """True while the stage's query runs."""
        return self.query is not None and self.query.isActive

    @property
    def warm(self) -> bool:
        """This run's query has completed a micro-batch (planning, state store and Python workers are up). A batch
        the checkpoint holds does not count: after a restore the query's first batch is still to be paid for."""
        return self._ran_batch

    # ------------------------------------------------------------------ epochs from the driver

    def request_epoch(self, epoch: int) -> None:
        """A new epoch is in flight: a source stage injects it at its next batch boundary; a channel stage with
        an ``alignment_timeout`` starts counting how long the epoch waits for its barriers."""
        if self.kind is not StageKind.SOURCE:
            if self._unaligned_allowed:
                with self._uncut_lock:
                    if epoch > self._last_cut_epoch:
                        self._uncut.setdefault(epoch, time.monotonic())
                self.cut_if_idle()
            return
        with self._lock:
            if epoch > self._last_cut_epoch:
                self._pending.add(epoch)
                self._aligning_since.setdefault(epoch, time.monotonic())
        self.cut_if_idle()

    def cut_if_idle(self) -> None:
        """Between batches: cut an idle source stage at its last completed batch, or a channel stage whose
        pending epoch waited ``alignment_timeout`` for its barriers (never blocks on a running batch: that
        batch's writer makes the cut itself when it ends)."""
        if self.kind is StageKind.SOURCE:
            if not self._pending:
                return
        elif not self._uncut:
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self.kind is StageKind.SOURCE:
                self._source_cut(self._last_completed)
            else:
                self._unaligned_cut(self._last_completed)
        finally:
            self._lock.release()

    @property
    def _unaligned_allowed(self) -> bool:
        # an iteration head's feedback cursors follow FLIP-16 (its ack waits for the barrier to come back)
        return self.alignment_timeout is not None and self.kind is not StageKind.SOURCE and not self.spec.feedback

    # ------------------------------------------------------------------ the writer

    def open_gate(self) -> None:
        """Let the first micro-batch run (the driver opens every stage's gate once all started)."""
        self._gate.set()

    def set_backpressure(self, backlog: Callable[[], int], max_entries: int) -> None:
        """Hold this stage's next micro-batch while ``backlog()`` (entries of its output its slowest
        aligned reader has not read yet) exceeds ``max_entries``: a fast stage cannot run ahead of a slow
        one without bound, so a barrier never waits behind an unbounded queue."""
        self._backlog = backlog
        self._max_backlog = max_entries

    def _wait_for_readers(self) -> None:
        # Outside the stage lock: the driver's poller may cut this (source) stage meanwhile.
        if self._backlog is None:
            return
        delay = 0.01
        while not self._closing and self._backlog() > self._max_backlog:
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def _foreach_batch(self, df: DataFrame, batch_id: int) -> None:
        self.batch_started.set()
        while not self._gate.wait(0.2):
            if self._closing:
                raise ArroyoError(f"stage {self.name!r} is stopping before its first micro-batch ran")
        self._wait_for_readers()
        try:
            # The lock covers the data append too: a cut decided by the driver's poller (at the last
            # completed batch) must never slip its barrier between this batch's data and its bookkeeping.
            with self._lock:
                self._write(df, batch_id)
                self._last_completed = batch_id
                self._ran_batch = True
                if self.kind is StageKind.SOURCE:
                    self._source_cut(batch_id)
                else:
                    self._channel_cut(batch_id)
        except BaseException as exc:
            self.errors.append(exc)
            if self._closing:  # the stop cancelled its jobs: expected, not a failure to report with a trace
                log.info("pipeline=%s stage=%s: micro-batch %s ended by the stop (%s)", self.pipeline_id, self.name,
                         batch_id, _first_line(exc))
            else:
                log.exception("pipeline=%s stage=%s: micro-batch %s failed", self.pipeline_id, self.name, batch_id)
            if type(exc).__name__ == "Py4JJavaError":
                raise ArroyoError(brief_java_error(exc)) from None
            raise

    def _write(self, df: DataFrame, batch_id: int) -> None:
        spec = self.spec
        if self.output is not None:
            latest = self.output.last_batch_id(self.name)
            if latest is not None and batch_id <= latest:
                # a replay of a batch already in the channel: compute it anyway so that stateful
                # operators commit their state version, but append nothing
                df.write.format("noop").mode("overwrite").save()
                return
            self.output.append_spark_batch(df, batch_id, self.name)
        elif self.sink is not None:
            self.sink.write_batch(df, batch_id)  # pre-commit; the driver commits it with its epoch
        elif spec.foreach_batch is not None:
            spec.foreach_batch(df, batch_id)
        elif spec.sink_format is not None:
            df.write.format(spec.sink_format).options(**dict(spec.sink_options)).mode("append").save()

    def _source_cut(self, batch_id: int) -> None:
        """Under the lock: inject pending epochs after ``batch_id``'s data."""
        epochs = source_cut(self._pending, self._last_cut_epoch)
        self._pending.clear()
        for epoch in epochs:
            started = self._aligning_since.pop(epoch, time.monotonic())
            self._cut(epoch, batch_id, cursors={}, alignment_ms=(time.monotonic() - started) * 1000)

    def _channel_cut(self, batch_id: int) -> None:
        """Under the lock: align on the inputs' barriers; cut when all delivered."""
        offsets = self._input_offsets(batch_id)
        self.consumed.update(offsets)
        spec = self.spec
        ends = []
        for channel in spec.inputs:
            end = offsets[channel]
            ends.append(InputEnd(channel, end, self._barrier_before(channel, end)))
        for channel in spec.feedback:
            self._feedback_ends[channel] = offsets[channel]
        self._last_ends = (batch_id, {e.channel: e.end for e in ends})
        decision = decide_alignment(ends, self._last_cut_epoch)
        if decision.action is AlignmentAction.ALIGNING:
            assert decision.epoch is not None
            if decision.epoch not in self._aligning_since:
                self._aligning_since[decision.epoch] = time.monotonic()
                log.info("pipeline=%s epoch=%s stage=%s: aligning: barrier delivered on %s, waiting for %s",
                         self.pipeline_id, decision.epoch, self.name, ", ".join(decision.delivered),
                         ", ".join(decision.waiting_for))
            self._write_caps(dict(decision.caps))
        elif decision.action is AlignmentAction.CUT:
            self._on_cut(decision, batch_id)
        self._unaligned_cut(batch_id)
        self._release_feedback_acks()

    def _unaligned_cut(self, batch_id: int) -> None:
        """Under the lock: cut the epochs that waited ``alignment_timeout`` for their barriers at ``batch_id`` (the
        last completed batch), with that batch's ends as cursors: each is at or before the barrier on its input
        (a reader never crosses one), so what lies between stays in the channel for a restore to read again."""
        if not self._uncut:
            return
        with self._uncut_lock:
            for done in [e for e in self._uncut if e <= self._last_cut_epoch]:
                del self._uncut[done]
            uncut = dict(self._uncut)
            epochs = unaligned_cut(uncut, self._last_cut_epoch, time.monotonic(), self.alignment_timeout,
                                   has_feedback=bool(self.spec.feedback), has_batch=batch_id >= 0)
            for epoch in epochs:
                del self._uncut[epoch]
        if not epochs:
            return
        if self._last_ends is not None and self._last_ends[0] == batch_id:
            ends = dict(self._last_ends[1])
        else:  # no batch of this run yet (a restored query): the checkpoint's offsets of that batch
            offsets = self._input_offsets(batch_id)
            ends = {c: offsets[c] for c in self.spec.inputs}
        for epoch in epochs:
            since = uncut[epoch]
            self._aligning_since.pop(epoch, None)
            self._cut(epoch, batch_id, cursors=dict(ends), alignment_ms=(time.monotonic() - since) * 1000,
                      unaligned=True)

    def _on_cut(self, decision: AlignmentDecision, batch_id: int) -> None:
        assert decision.epoch is not None
        started = self._aligning_since.pop(decision.epoch, None)
        alignment_ms = 0.0 if started is None else (time.monotonic() - started) * 1000
        cursors = dict(decision.cursors)
        for channel in self.spec.feedback:
            cursors[channel] = self._feedback_ends.get(channel, self.inputs[channel].start_position())
        self._cut(decision.epoch, batch_id, cursors=cursors, alignment_ms=alignment_ms)

    def _cut(self, epoch: int, batch_id: int, *, cursors: dict[str, int], alignment_ms: float,
             unaligned: bool = False) -> None:
        """Under the lock: forward barrier ``epoch`` after ``batch_id``'s output, lift caps, snapshot."""
        t0 = time.monotonic()
        barrier = self.output.append_barrier(epoch, self.name) if self.output is not None else None
        self._write_caps({})
        self._last_cut_epoch = epoch
        # Entries before the cut are not read again by this run (alignment reads from the cut on; a restore opens
        # the channels afresh), so their parsed copies go: a run lasts months. Feedback inputs are searched back
        # for returning barriers and keep theirs (their handles still bound them).
        if barrier is not None and self.output is not None:
            self.output.forget_before(barrier)
        for channel in self.spec.inputs:
            if channel in cursors:
                self.inputs[channel].forget_before(cursors[channel] - 1)
        sync_ms = (time.monotonic() - t0) * 1000
        record = CutRecord(epoch, batch_id, dict(cursors), alignment_ms, sync_ms, barrier, unaligned=unaligned)
        self.cuts.append(record)
        log.info("pipeline=%s epoch=%s stage=%s: %scut at batch %s (barrier at %s, alignment %.0f ms)",
                 self.pipeline_id, epoch, self.name, "unaligned " if unaligned else "", batch_id, barrier,
                 alignment_ms)
        pending = _Pending(epoch, batch_id, dict(cursors), alignment_ms, sync_ms, unaligned=unaligned)
        if self.spec.feedback:
            pending.snapshot = self.executor.submit(self._snapshot, epoch, batch_id)
            self._deferred.append(pending)
        else:
            self.executor.submit(self._snapshot_and_ack, pending)

    # ------------------------------------------------------------------ snapshot and ack (async)

    def _snapshot(self, epoch: int, batch_id: int) -> Any:
        record = self._epoch_record(epoch)
        if record is None or not record.state.in_flight:
            return None
        return self.snapshots.capture(self.name, epoch, self.checkpoint, batch_id,
                                      commit_timeout=self.commit_timeout, alive=self.alive,
                                      self_contained=record.self_contained)

    def _snapshot_and_ack(self, pending: _Pending) -> None:
        epoch = pending.epoch
        try:
            result = pending.snapshot.result() if pending.snapshot is not None else self._snapshot(
                epoch, pending.batch_id)
            if result is None:
                log.info("pipeline=%s epoch=%s stage=%s: epoch no longer in flight; snapshot skipped",
                         self.pipeline_id, epoch, self.name)
                return
            ack = self.store.acknowledge(
                self.pipeline_id, epoch, self.name, token=self.token, cursors=pending.cursors,
                alignment_ms=pending.alignment_ms,
                sync_ms=pending.sync_ms, async_ms=result.wait_ms + result.copy_ms,
                bytes_new=result.bytes_new, bytes_total=result.bytes_total,
                snapshot_uri=self.layout.fs.uri_of(self.layout.snapshots_dir),
                details={"batch_id": pending.batch_id, "unaligned": pending.unaligned, "files": len(result.entries),
                         "files_copied": result.files_copied, "commit_wait_ms": round(result.wait_ms, 1),
                         "copy_ms": round(result.copy_ms, 1),
                         "state_bytes": state_bytes((e.rel_path, e.object_key, e.bytes) for e in result.entries),
                         "state_rows": self._state_rows(pending.batch_id)},
            )
            log.info("pipeline=%s epoch=%s stage=%s: acknowledged (%s bytes new of %s): %s; epoch is %s",
                     self.pipeline_id, epoch, self.name, result.bytes_new, result.bytes_total, ack.outcome.value,
                     ack.state)
        except FencedError as exc:  # superseded: write nothing more (not even the epoch's failure)
            log.error("pipeline=%s epoch=%s stage=%s: %s", self.pipeline_id, epoch, self.name, exc)
            self.errors.append(exc)
        except (SnapshotError, ArroyoError, OSError) as exc:
            log.error("pipeline=%s epoch=%s stage=%s: snapshot failed: %s", self.pipeline_id, epoch, self.name, exc)
            self._fail_epoch(epoch, f"stage {self.name}: snapshot failed: {exc}")
        except Exception as exc:  # an unexpected bug must still fail the epoch, not vanish
            log.exception("pipeline=%s epoch=%s stage=%s: snapshot crashed", self.pipeline_id, epoch, self.name)
            self._fail_epoch(epoch, f"stage {self.name}: snapshot crashed: {type(exc).__name__}: {exc}")

    def _state_rows(self, batch_id: int) -> int | None:
        """Rows in the stage's state after ``batch_id``: the sum of ``stateOperators[].numRowsTotal`` of that
        batch's progress, which Spark reports right after it commits the batch. None when the query has no state,
        or when the progress is not there (not reported yet, or older than Spark's recent progress list)."""
        query = self.query
        if query is None or batch_id < 0:
            return None
        try:
            progress: dict[str, Any] | None = query.lastProgress
            if progress is None or progress.get("batchId") != batch_id:  # later batches ran: look further back
                progress = next((p for p in reversed(query.recentProgress) if p.get("batchId") == batch_id), None)
        except Exception:  # noqa: BLE001 - a figure for the UI: a query that stopped meanwhile must not fail the ack
            return None
        operators = progress.get("stateOperators") if progress is not None else None
        return sum(int(o.get("numRowsTotal", 0)) for o in operators) if operators else None

    def _fail_epoch(self, epoch: int, reason: str) -> None:
        try:
            self.store.fail_epoch(self.pipeline_id, epoch, reason[:2000], token=self.token)
        except ArroyoError:
            log.exception("pipeline=%s epoch=%s stage=%s: could not mark the epoch failed", self.pipeline_id,
                          epoch, self.name)

    def _epoch_record(self, epoch: int) -> EpochRecord | None:
        try:
            return self.store.get_epoch(self.pipeline_id, epoch)
        except UnknownEpochError:
            return None

    def _release_feedback_acks(self) -> None:
        """Iteration head: acknowledge an epoch once its barrier came back on every feedback input."""
        if not self._deferred:
            return
        still: list[_Pending] = []
        for p in self._deferred:
            positions = {c: self.inputs[c].find_barrier(p.epoch) for c in self.spec.feedback}
            if feedback_returned(positions, {c: self._feedback_ends.get(c, 0) for c in self.spec.feedback}):
                self.executor.submit(self._snapshot_and_ack, p)
            else:
                still.append(p)
        self._deferred = still

    # ------------------------------------------------------------------ helpers

    def _input_offsets(self, batch_id: int) -> dict[str, int]:
        raw = checkpoint_offsets(self._checkpoint_fs, batch_id)
        out: dict[str, int] = {}
        for offset in raw:
            if offset is not None and "key" in offset:
                out[str(offset["key"])] = int(offset["pos"])
        missing = [c for c in self.spec.all_inputs if c not in out]
        if missing:
            raise ConfigurationError(
                f"stage {self.name!r}: the query does not read input(s) {', '.join(missing)} (no offsets in batch "
                f"{batch_id}); the transform must use every DataFrame it is given, or drop the input from inputs=[...]"
            )
        return out

    def _barrier_before(self, channel: str, end: int) -> int | None:
        if end <= 0:
            return None
        ch = self.inputs[channel]
        if end - 1 < ch.start_position():
            return None
        entry = ch.entry(end - 1)
        return entry.epoch if entry.kind is EntryKind.BARRIER else None

    def _write_caps(self, caps: dict[str, int]) -> None:
        if self.kind is StageKind.SOURCE:
            return
        if caps == self._caps and self.layout.fs.exists(self._caps_path):
            return
        write_caps(self.caps_uri, caps)
        self._caps = dict(caps)

    @property
    def fenced(self) -> FencedError | None:
        """The refusal that told this stage its run was superseded, if one did."""
        return next((e for e in self.errors if isinstance(e, FencedError)), None)

    def stop(self, grace: float = 120.0) -> None:
        """Stop the stage's query and make sure its stream thread has ended.

        Spark's ``stop()`` waits ``spark.sql.streaming.stopTimeout`` for the thread, then raises and leaves it
        running (a micro-batch blocked in Python cannot be interrupted), still able to write the checkpoint. Then
        this waits ``grace`` seconds more and raises :class:`QueryStillRunningError` if the thread still runs."""
        self._closing = True
        query = self.query
        if query is None or not query.isActive:
            return
        try:
            query.stop()
            return
        except Exception as exc:  # noqa: BLE001 - whatever Spark said, the question is whether the thread ended
            failure: Exception = exc
        # awaitTermination cannot tell: it answers "not active", true from the moment stop() began; the stream
        # thread itself can (StreamExecution.queryExecutionThread)
        try:
            thread = query._jsq.streamingQuery().queryExecutionThread()
            thread.join(int(grace * 1000))
            ended = not thread.isAlive()
        except Exception:  # noqa: BLE001 - cannot tell (the session is gone): Spark's own error says most
            raise failure from None
        if not ended:
            raise QueryStillRunningError(
                f"stage {self.name!r}: its query's stream thread still ran {grace:g}s after Spark's stop gave up "
                f"({_first_line(failure)}); it may still write the stage's checkpoint, so the run is not reported "
                "stopped (a micro-batch blocked in user code? spark.sql.streaming.stopTimeout bounds Spark's wait)")
        log.warning("pipeline=%s stage=%s: the query ended after Spark's stop gave up on it (%s)", self.pipeline_id,
                    self.name, _first_line(failure))


class QueryStillRunningError(ArroyoError):
    """A stage's query did not end when stopped: its stream thread may still write."""


def _first_line(exc: BaseException) -> str:
    """The Java exception's line of a py4j error (``: java.util.concurrent.TimeoutException: ...``), else the
    first line."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    java = next((ln[2:] for ln in lines if ln.startswith(": ")), None)
    return (java or (lines[0] if lines else type(exc).__name__))[:300]


_BRIEF_LIMIT = 1000
# StreamExecution.IO_EXCEPTION_NAMES: the exceptions Spark reads as its query's own stop
_INTERRUPTIONS = ("java.lang.InterruptedException", "java.io.InterruptedIOException",
                  "java.nio.channels.ClosedByInterruptException")


def brief_java_error(exc: BaseException) -> str:
    r"""A Java error raised through py4j, as Spark should see it come back from ``foreachBatch``: its lead lines
    (``py4j.protocol.Py4JJavaError: An error occurred while calling ...`` and the Java exception), without stack
    frames, at most 1,000 characters.

    Spark decides whether a failed query was interrupted by its stop by matching ``StreamExecution.PROXY_ERROR``
    (``...calling((.|\r\n|\r|\n)*)(java.lang.InterruptedException|...)``) against the Python traceback it
    gets back. That expression recurses once per character: the whole Java stack of the error made the stream
    thread die of ``StackOverflowError``, and the query ended with no exception at all. The full error stays in
    the stage's ``errors`` and the log."""
    lines = [ln for ln in f"py4j.protocol.Py4JJavaError: {exc}".splitlines()
             if ln.strip() and not ln.startswith(("\tat ", "\t... ", "\tSuppressed: "))]
    text = "\n".join(lines)
    if len(text) <= _BRIEF_LIMIT:
        return text
    # an interruption deep in the causes must stay visible, or Spark takes its own stop for a failure
    cause = next((ln[:300] for ln in lines[1:] if any(name in ln for name in _INTERRUPTIONS)), None)
    if cause is None:
        return text[:_BRIEF_LIMIT]
    return text[:_BRIEF_LIMIT - len(cause) - 1] + "\n" + cause


def check_channels_have_barrier(channels: Mapping[str, Channel], epoch: int) -> dict[str, int]:
    """Each channel's position right after barrier ``epoch`` (restore truncates there)."""
    out: dict[str, int] = {}
    for name, ch in channels.items():
        pos = ch.find_barrier(epoch)
        if pos is None:
            raise ChannelError(
                f"channel {name!r} ({ch.uri}) has no barrier of epoch {epoch}; it cannot be restored to that epoch "
                "(was it truncated or written by another pipeline?): choose another epoch"
            )
        out[name] = pos + 1
    return out
