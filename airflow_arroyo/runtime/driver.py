r"""The pipeline driver: one Spark application runs a whole pipeline and takes part in its epochs.

The driver validates the graph (before Spark starts), registers the run in the epoch store, restores
the stages' checkpoints and truncates the channels when asked to, starts one streaming query per stage
(concurrent queries sharing the executors), and then loops:

* reads the in-flight epoch when the database announces an epoch start or end (LISTEN/NOTIFY; every
  ``poll_interval`` while it cannot listen) and tells the source stages to inject it;
* cuts idle source stages at their last completed micro-batch;
* heartbeats; watches the queries (a failed query fails the pipeline with its cause and fails the
  in-flight epoch);
* on ``stop_requested == 'graceful'``: state ``stopping``, one **final epoch** (Flink's
  stop-with-savepoint), wait for it, stop the queries, state ``stopped``; on ``'immediate'``: stop now.

What to restore, the next step of a stop and which sink commits to make are pure decisions
(:mod:`airflow_arroyo.runtime.decisions`): the driver reads the facts, asks, and applies the answer.

Command line (also a ``spark-submit`` application; the DSN comes from ``ARROYO_DSN`` or the file
``ARROYO_DSN_FILE`` names, so that no secret is on the command line)::

    spark-submit .../airflow_arroyo/runtime/driver.py --pipeline pkg.module:attr --run-id RUN \\
        [--restore-from latest|N] [--storage-uri URI] [--checkpoint-uri URI] [--takeover] [--arg key=value ...]

``attr`` is a :class:`~airflow_arroyo.runtime.pipeline.Pipeline` or a function returning one (called
with the ``--arg`` values as keyword arguments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, TriggerAction
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConcurrencyConflict,
    ConfigurationError,
    FencedError,
    PipelineFailedError,
    StageBuildError,
    UnknownPipelineError,
    UnrestorableEpochError,
)
from airflow_arroyo.core.memory import release_free_memory
from airflow_arroyo.core.restores import read_restore_facts
from airflow_arroyo.jvm import SocketPathPruner, master_conf
from airflow_arroyo.runtime.alignment import validate_alignment_timeout
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.decisions import (
    RestoreAction,
    RestoreFacts,
    RestoreFrom,
    RestorePlan,
    StopAction,
    StopDecision,
    StopFacts,
    StopMode,
    UpgradePlan,
    decide_stop,
    epoch_to_commit,
    epochs_still_to_commit,
    plan_restore,
    sink_cuts,
    sinks_to_commit,
)
from airflow_arroyo.runtime.gatekeeper import GateKeeper, GateStop
from airflow_arroyo.runtime.graph import sink_kind, stage_identities
from airflow_arroyo.runtime.kafka_offsets import KafkaSource, kafka_offsets, kafka_sources, lost_offsets
from airflow_arroyo.runtime.layout import StorageLayout, object_path
from airflow_arroyo.runtime.pipeline import Pipeline, PipelineGraph, StageKind
from airflow_arroyo.runtime.plan import (
    PhysicalPlan,
    compose_stages,
    decide_fusion,
    plan_chains,
    stateful_stages,
    watermarks_not_crossing,
)
from airflow_arroyo.runtime.read_limits import query_read_limits, unbounded_source_warning, unbounded_sources
from airflow_arroyo.runtime.refusion import empty_delta_file, merge_checkpoint, split_checkpoint
from airflow_arroyo.runtime.rescale import rescale_checkpoint
from airflow_arroyo.runtime.sinks import TransactionalSink, transactional_sink
from airflow_arroyo.runtime.sinks.files import TransactionalFileSink
from airflow_arroyo.runtime.snapshot import PreparedRestore, SnapshotStore
from airflow_arroyo.runtime.stage import (
    QueryStillRunningError,
    StageRunner,
    check_channels_have_barrier,
    trigger_interval,
)
from airflow_arroyo.runtime.startup import start_phases
from airflow_arroyo.runtime.upgrade_evidence import StateSchemas, gather_state_schemas, snapshot_state_files
from airflow_arroyo.store import EpochRecord, EpochStore, EpochWatch, FencingToken, PipelineRecord, redact_dsn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from airflow_arroyo.core.fs import FileSystem

__all__ = ["DriverResult", "PipelineDriver", "RestoreFrom", "check_registrable", "dsn_from_environment",
           "load_pipeline", "main"]

log = logging.getLogger(__name__)

# SQL confs the driver sets unless the session already has them.
DEFAULT_SQL_CONF = {
    # Spark must not delete checkpoint files an in-progress asynchronous snapshot still copies.
    "spark.sql.streaming.minBatchesToRetain": "200",
}


# Longest time between two reads of the in-flight epoch while the database's announcements are heard.
EPOCH_READ_FALLBACK = 5.0

# A registered run that has not heartbeated for this long is presumed dead: a new run takes it over.
DEFAULT_STALE_AFTER = 30.0

# How long the warm-up waits for every query's first micro-batch before the run goes `running` anyway: a restored
# stage's first batch loads its state, starts its Python workers and generates code, and an epoch started during it
# waits for all of that (figures: benchmarks/results/recovery.md).
DEFAULT_WARMUP_TIMEOUT = 120.0

# How many of the newest epochs a run saw its result lists (DriverResult.epochs_seen; epochs_seen_count counts all).
EPOCHS_SEEN_KEPT = 256


@dataclass
class DriverResult:
    """How a run ended."""

    pipeline_id: str
    run_id: str
    state: PipelineState
    restored_from_epoch: int | None = None
    final_epoch: int | None = None
    epochs_seen: list[int] = field(default_factory=list)  # the newest EPOCHS_SEEN_KEPT epochs it saw, oldest first
    failure_cause: str | None = None
    epochs_seen_count: int = 0  # every epoch it saw


@dataclass
class _LoopState:
    """What the driver's loop carries from one turn to the next."""

    last_seen: int  # the newest epoch handed to the stages
    app_id: str | None = None  # the Spark application, reported with each heartbeat
    ui_url: str | None = None
    last_heartbeat: float = 0.0
    last_read: float = 0.0  # when the in-flight epoch was last read (monotonic)
    in_flight: EpochRecord | None = None
    previous_in_flight: int | None = None
    stopping: bool = False  # marked `stopping` (a graceful stop)
    final_epoch: int | None = None  # the final epoch in flight
    final_attempts: int = 0
    final_deadline: float = 0.0


class PipelineDriver:
    """Runs one pipeline in one Spark application. Use :meth:`run` (blocks until the pipeline ends)."""

    # Flow control: entries a channel may hold that its slowest aligned reader has not read (0: no bound).
    DEFAULT_MAX_BACKLOG = 16
    # How long a stop waits for a query's stream thread after Spark's own stop gave up on it (stopTimeout).
    query_stop_grace: float = 120.0

    def __init__(
        self,
        pipeline: Pipeline,
        store: EpochStore,
        *,
        storage_uri: str,
        checkpoint_uri: str | None = None,
        run_id: str | None = None,
        restore_from: RestoreFrom = None,
        spark: SparkSession | None = None,
        poll_interval: float = 0.15,
        heartbeat_interval: float = 2.0,
        final_epoch_timeout: float = 300.0,
        takeover: bool = False,
        stale_after: float = DEFAULT_STALE_AFTER,
        commit_timeout: float = 300.0,
        own_spark: bool | None = None,
        max_backlog_entries: int | None = None,
        warmup_timeout: float = DEFAULT_WARMUP_TIMEOUT,
        allow_dropped_state: Sequence[str] = (),
        renamed: Mapping[str, str] | None = None,
        rescale: Mapping[str, int] | None = None,
        alignment_timeout: float | None = None,
    ) -> None:
        # seconds an epoch waits for its barriers at a channel stage before the stage cuts unaligned (None: always
        # aligned; 0: at once), as Flink's execution.checkpointing.aligned-checkpoint-timeout
        self.alignment_timeout = validate_alignment_timeout(alignment_timeout)
        self.logical: PipelineGraph = pipeline.validate()  # before Spark starts or anything is written
        # what runs: one stage per fused group (runtime/plan.py); the stages themselves until run() asks Spark
        # which are stateful (without that no two stages fuse)
        self.plan: PhysicalPlan = plan_chains(self.logical, chaining=pipeline.chains)
        self.graph: PipelineGraph = self.plan.graph
        self.pipeline = pipeline
        self.pipeline_id = pipeline.pipeline_id
        self.store = store
        self.storage_uri = storage_uri
        self.checkpoint_uri = checkpoint_uri or storage_uri
        self.run_id = run_id or f"run-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.restore_from = _parse_restore_from(restore_from)
        self.layout = StorageLayout.at(storage_uri, self.pipeline_id, checkpoint_uri)
        self.poll_interval = poll_interval
        self.heartbeat_interval = heartbeat_interval
        self.final_epoch_timeout = final_epoch_timeout
        self.takeover = takeover
        self.stale_after = stale_after
        self.commit_timeout = commit_timeout
        self.max_backlog_entries = self.DEFAULT_MAX_BACKLOG if max_backlog_entries is None else max_backlog_entries
        self.warmup_timeout = warmup_timeout
        # an upgrade (docs/upgrading.md): the epoch's stages whose state this code drops, and old -> new stage names
        self.allow_dropped_state = tuple(allow_dropped_state)
        self.renamed = dict(renamed or {})
        self.rescale = dict(rescale or {})  # stage -> the state partitions its restored checkpoint is rewritten into
        self._upgrade: UpgradePlan | None = None  # what each stage becomes in this run's restore
        self._fresh_channels: set[str] = set()  # written by stages that start afresh in an upgrade: empty, at 0
        self._stateful: Mapping[str, bool | None] = {}  # logical stage -> whether it holds state (Spark's analyzer)
        self._frames: Mapping[str, Any] = {}  # logical stage -> its composed DataFrame (no query started)
        # stage split from a fused query of the epoch -> (it keeps the state, the channel it now reads or None)
        self._splits: dict[str, tuple[bool, str | None]] = {}
        # fused stage merged from stages the epoch ran as their own queries -> (its source stage, its stateful one)
        self._merges: dict[str, tuple[str, str | None]] = {}
        self._channel_starts: dict[str, dict[str, int]] = {}  # new stage -> input channel -> where it starts
        self._spark = spark
        self._own_spark = spark is None if own_spark is None else own_spark
        self.runners: list[StageRunner] = []
        self.snapshots = SnapshotStore(self.layout.fs, self.pipeline_id, store, checkpoints=self.layout.checkpoint_fs)
        self._executor: ThreadPoolExecutor | None = None
        self._epoch_watch: EpochWatch | None = None
        self.socket_paths: SocketPathPruner | None = None  # with the session: airflow_arroyo.jvm
        self._stop = threading.Event()
        self._stop_mode: StopMode | None = None
        # the epochs this run saw: how many, the newest few, and those its sinks may still commit (not every one)
        self._epochs_seen_count = 0
        self._epochs_seen: deque[int] = deque(maxlen=EPOCHS_SEEN_KEPT)
        self._epochs_to_commit: list[int] = []
        self.restored_from_epoch: int | None = None
        self._fork_source: PipelineRecord | None = None  # set when this run restores a fork's fork point
        self._kafka_sources: list[KafkaSource] = []  # the pipeline's Kafka sources (from Spark's analyzed plans)
        self.started = threading.Event()  # set once every query runs (tests wait on it)
        # exactly-once sinks (files, PostgreSQL): pre-committed by their stage, committed here when an epoch completes
        self.sinks: dict[str, TransactionalSink] = self._transactional_sinks()
        self.gates = self._gatekeeper()  # gated sinks: their output waits for verdicts (airflow_arroyo.core.gates)
        self._sinks_committed = 0  # the last epoch whose sink batches are committed
        self.token: FencingToken | None = None  # this run's fencing token, taken right after registering
        # Test seam: called with the name of each step of a start (see _restore) before the next begins; a
        # test raises there (a failure) or blocks there (a kill: nothing after it happens).
        self.on_step: Callable[[str], None] | None = None
        # when each step of this run's start ended, seconds since run() began (runtime/startup.py)
        self.step_times: dict[str, float] = {}
        self._run_began = time.monotonic()
        # called once an epoch has ended: the C library's free memory back to the OS (airflow_arroyo.core.memory);
        # None turns it off (benchmarks/soak.py --no-release), a test counts the calls here
        self.release_memory: Callable[[], object] | None = release_free_memory
        self.memory_releases = 0  # how many, and their total seconds (benchmarks/soak.py reports the cost)
        self.memory_release_seconds = 0.0

    def _transactional_sinks(self) -> dict[str, TransactionalSink]:
        return {s.name: sink for s in self.graph.stages if s.output is None
                if (sink := transactional_sink(self.pipeline_id, s, self.layout.fs.child(
                    f"{self.layout.stage_dir(s.name)}/staging"))) is not None}

    def _declared(self, physical: str) -> str:
        """The name the user gave a sink, a fused query's last stage: what its gates, its commit records (so its
        Asset events) and its provenance go by, whether or not the sink is fused."""
        return next((g.stages[-1] for g in self.plan.groups if g.name == physical), physical)

    def _gatekeeper(self) -> GateKeeper:
        """The gated sinks of the physical graph, by the name the user gave the sink."""
        gated = {s.name: (self._declared(s.name), s.gate.checked(s.name, sink_kind(s) or ""))
                 for s in self.graph.stages if s.gate is not None and s.name in self.sinks}
        return GateKeeper(self.pipeline_id, self.run_id, self.store, self.sinks, gated)

    def _plan_chains(self) -> None:
        """Ask Spark's analyzer about the stages (composed, no query started); warn of a watermark that a
        remaining channel drops (:func:`~airflow_arroyo.runtime.plan.watermarks_not_crossing`); for a chaining
        pipeline, :meth:`_fuse`."""
        spark = self._session()
        frames = compose_stages(self.logical, spark)
        self._kafka_sources = [k for s in self.logical.stages if s.kind is StageKind.SOURCE
                               if (df := frames.get(s.name)) is not None for k in kafka_sources(df)]
        stateful = stateful_stages(self.logical, spark, frames)
        self._stateful = stateful
        self._frames = frames
        if self.pipeline.chains:
            self._fuse(stateful)
        for warning in watermarks_not_crossing(self.logical, self.plan, frames, stateful):
            log.warning("pipeline=%s: %s", self.pipeline_id, warning)

    def _fuse(self, stateful: Mapping[str, bool | None]) -> None:
        """Fuse as :func:`~airflow_arroyo.runtime.plan.decide_fusion` decides (the upgrade's dry runs decide there
        too) and run that physical graph from here on (its stage names are what the store records and a restore
        checks). When the graph decides (``chaining=None``) and this run restores an epoch taken unfused, it runs
        unfused: that epoch holds a snapshot per stage, not per fused query."""

        def restoring() -> tuple[int, tuple[str, ...]] | None:
            epoch = self._restore_facts().epoch
            return None if epoch is None else (epoch.epoch, epoch.stages)

        fusion = decide_fusion(self.logical, stateful, chaining=self.pipeline.chaining, restoring=restoring)
        if fusion.unfused_for_epoch is not None:
            log.info("pipeline=%s: epoch %d was taken with every stage its own query; this run restores it "
                     "and runs unfused (a run that starts afresh fuses; Pipeline(chaining=True) refuses such "
                     "a restore)", self.pipeline_id, fusion.unfused_for_epoch)
            return
        assert fusion.plan is not None  # with Spark's facts the plan is always decided
        self.plan = fusion.plan
        self.graph = self.plan.graph
        self.sinks = self._transactional_sinks()
        self.gates = self._gatekeeper()
        log.info("pipeline=%s: physical plan:\n%s", self.pipeline_id, self.plan.explain())

    # ------------------------------------------------------------------ public

    def request_stop(self, mode: str = "graceful") -> None:
        """Stop from inside the process (signal handlers, tests); the store's stop request works too."""
        self._stop_mode = StopMode(mode)
        self._stop.set()

    def run(self) -> DriverResult:
        """Restore if asked, start every stage, take part in epochs until stopped; returns how it ended.

        Raises :class:`PipelineFailedError` when a stage fails (the store records the cause), and
        :class:`SnapshotError` / :class:`ConfigurationError` when a restore is impossible.
        """
        self._run_began = time.monotonic()
        self._plan_chains()  # which stages run fused; watermarks a channel drops (Spark's analyzer)
        plan = self._plan_restore()  # reads only: refuse bad input before writing anything
        self._upgrade = plan.upgrade
        self._register()  # owns the pipeline from here on; changes no epoch
        self._take_token()
        try:
            self._step("registered")
            self._clean_leftovers()
            if plan.action is RestoreAction.RESTORE and self._fork_source is not None:
                assert plan.epoch is not None
                self._restore_fork(self._fork_source, plan.epoch)
            elif plan.action is RestoreAction.RESTORE:
                assert plan.epoch is not None
                self._restore(plan.epoch)
            elif plan.action is RestoreAction.START_OVER:
                self._start_over()
            self._fence_channels(plan.epoch)
            for sink in self.sinks.values():
                sink.claim()
            spark = self._session()
            self.socket_paths = SocketPathPruner(spark)
            self._executor = ThreadPoolExecutor(max_workers=max(2, min(8, len(self.graph.stages))),
                                                thread_name_prefix=f"arroyo-snapshot-{self.pipeline_id}")
            self._start_stages(spark)
            self.started.set()
            log.info("pipeline=%s run=%s: running %d stages (restored from epoch %s); start phases: %s",
                     self.pipeline_id, self.run_id, len(self.runners), self.restored_from_epoch,
                     ", ".join(f"{k} {v:.2f}s" for k, v in start_phases(self.step_times).items()))
            return self._loop()
        except ConcurrencyConflict:
            self._stop_queries()
            raise
        except BaseException as exc:
            cause = (exc.cause or "") if isinstance(exc, PipelineFailedError) else _cause(exc)
            log.error("pipeline=%s run=%s: failed: %s", self.pipeline_id, self.run_id, cause)
            self._stop_queries()
            self._mark_failed(cause)
            if isinstance(exc, ArroyoError | KeyboardInterrupt):
                raise
            raise PipelineFailedError(self.pipeline_id, cause) from exc
        finally:
            if self._epoch_watch is not None:
                self._epoch_watch.close()
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
            self._close_sinks()
            if self._own_spark and self._spark is not None:
                self._spark.stop()

    # ------------------------------------------------------------------ restore planning

    def _has_state(self) -> bool:
        """Whether an earlier run left state here, in the physical form of this run or in the unfused one."""
        for name in dict.fromkeys([*self.graph.stage_names, *self.logical.stage_names]):
            if self.layout.checkpoint_fs.list_dir(self.layout.checkpoint(name)):
                return True
        for c in dict.fromkeys([*self.graph.channels, *self.logical.channels]):
            if Channel.exists(self.layout.channel_fs(c)) and Channel.open(self.layout.channel_fs(c)).end_position():
                return True
        return any(sink.has_state() for sink in self.sinks.values())

    def _plan_restore(self) -> RestorePlan:
        """What to restore (:func:`~airflow_arroyo.runtime.decisions.plan_restore`); reads only, so that bad
        input is refused before anything is written."""
        self.store.check_schema()
        facts = self._restore_facts()
        plan = plan_restore(facts)
        evidence = self._state_evidence(plan)
        if evidence:  # the same decision again, with what Spark would check when it loads the state
            plan = plan_restore(replace(facts, state_schemas=evidence))
        self._check_rescale(plan)
        if plan.upgrade is not None and plan.epoch is not None:
            self._splits = self._plan_splits(plan.upgrade, plan.epoch)
        for sink in self.sinks.values():
            sink.check_writable()  # read-only: before any restore touches the folder
        if plan.action is RestoreAction.START_OVER:
            log.info("pipeline=%s: no completed epoch to restore from; starting from the beginning", self.pipeline_id)
        return plan

    def _state_evidence(self, plan: RestorePlan) -> StateSchemas:
        """Reads only: for each restored query of the epoch's form (a stage alone, or a fused query of the same
        members), the stateful operators its snapshot holds and those this code's query would write
        (:func:`~airflow_arroyo.runtime.upgrade_evidence.gather_state_schemas`, as ``airflow-arroyo upgrade-plan
        --check-state-schema`` gathers them)."""
        if plan.upgrade is None or plan.epoch is None or self._fork_source is not None:
            return ()
        epoch = plan.epoch
        return gather_state_schemas(plan.upgrade, self.logical, self._frames, self._stateful, lambda snap: (
            snapshot_state_files(self.store, self.snapshots.fs, self.pipeline_id, epoch, snap)), physical=self.plan)

    def _check_rescale(self, plan: RestorePlan) -> None:
        """Refuse a rescale that names no stage this restore rebuilds, before anything is written."""
        if not self.rescale:
            return
        if plan.action is not RestoreAction.RESTORE:
            raise ConfigurationError(
                f"rescale= rewrites a restored stage's state; this run restores nothing ({plan.reason}): a stage "
                "that starts empty takes its spark_conf's spark.sql.shuffle.partitions")
        restored = plan.upgrade.snapshot_of() if plan.upgrade is not None else {n: n for n in self.graph.stage_names}
        unknown = sorted(set(self.rescale) - set(restored))
        if unknown:
            raise ConfigurationError(
                f"rescale= names {', '.join(unknown)}, which this restore does not rebuild from epoch {plan.epoch} "
                f"(restored stages: {', '.join(restored)}); a stage that starts empty takes its spark_conf's "
                "spark.sql.shuffle.partitions")

    def _plan_splits(self, upgrade: UpgradePlan, epoch: int) -> dict[str, tuple[bool, str | None]]:
        """Reads only: for each stage split from a fused query of ``epoch`` (docs/upgrading.md, "Across a change
        of fusion"), whether its checkpoint keeps the query's state and which channel it now reads. Refuses a
        split whose state would not go to exactly one query, or a stage that would read several channels."""
        splits: dict[str, tuple[bool, str | None]] = {}
        members = {g.name: g.stages for g in self.plan.groups}
        by_query: dict[str, list[str]] = {}
        for stage, fused in upgrade.across_fusion().items():
            if fused in members.get(stage, ()):  # a merge: its snapshot is its last member's
                self._merges[stage] = self._plan_merge(stage, members[stage], epoch)
                continue
            by_query.setdefault(fused, []).append(stage)
        for fused, stages in by_query.items():
            has_state = any(e.rel_path.startswith("state/")
                            for e in self.store.snapshot_entries(self.pipeline_id, epoch, fused))
            holders = [s for s in stages if any(self._stateful.get(m) is not False for m in members.get(s, (s,)))]
            if has_state and len(holders) != 1:
                raise ConfigurationError(
                    f"epoch {epoch}'s query {fused!r} holds state, and the new code would run "
                    f"{len(holders)} stateful or unanalyzed queries of its stages ({', '.join(holders) or 'none'}): "
                    "its state/<operator id> maps to one query only. Restore with the epoch's fusion, or drop its "
                    f"state with allow_dropped_state=[{fused!r}]")
            for s in stages:
                inputs = self.graph.stage(s).all_inputs
                if len(inputs) > 1:
                    raise ConfigurationError(
                        f"stage {s!r}, split from epoch {epoch}'s query {fused!r}, would read {len(inputs)} channels; "
                        "a split carries one input per query. Restore with the epoch's fusion, or drop its state "
                        f"with allow_dropped_state=[{fused!r}]")
                splits[s] = (has_state and s in holders, inputs[0] if inputs else None)
                sink = self.sinks.get(s)
                if isinstance(sink, TransactionalFileSink):
                    sink.previous_stage = fused  # it takes over the folder the fused query wrote
                elif sink is not None:
                    raise ConfigurationError(
                        f"sink {s!r}, split from epoch {epoch}'s query {fused!r}: its exactly-once bookkeeping "
                        f"({type(sink).__name__}) is kept under the query's name, and only a file sink's is carried "
                        "across a split yet. Restore with the epoch's fusion, or drop its state with "
                        f"allow_dropped_state=[{fused!r}]")
        return splits

    def _plan_merge(self, stage: str, members: Sequence[str], epoch: int) -> tuple[str, str | None]:
        """Reads only: the source stage and the stateful stage (None: none) of stages the epoch ran as their own
        queries that ``stage`` now runs fused, refusing by name what the renumbering does not carry."""
        way = (f"restore with the epoch's fusion (chain=False between them), or drop their state with "
               f"allow_dropped_state=[{', '.join(repr(m) for m in members)}]")
        in_flight = self._records_in_flight(members, epoch)
        if in_flight:
            raise ConfigurationError(
                f"stage {stage!r}: epoch {epoch} cut {in_flight} unaligned, with records in flight in the channel the "
                "merge removes (they would be lost); restore an epoch they were cut aligned in (a run with "
                f"alignment_timeout=None takes only those), or {way}")
        source = next(m for m in members if self.logical.stage(m).kind is StageKind.SOURCE)
        holders = [m for m in members if self._stateful.get(m) is not False]
        if len(holders) > 1:
            raise ConfigurationError(f"stage {stage!r} would merge stateful or unanalyzed stages "
                                     f"{', '.join(holders)} of epoch {epoch}; {way}")
        if any(e.rel_path.startswith("sources/") for e in self.store.snapshot_entries(self.pipeline_id, epoch, source)):
            raise ConfigurationError(f"stage {stage!r}: the source of {source!r} keeps a log by batch id (sources/) "
                                     f"that a merge would have to renumber; {way}")
        held = holders[0] if holders else None
        if held is not None and any(
                e.rel_path.startswith("state/") and re.search(r"\.(zip|changelog)$", e.rel_path)
                for e in self.store.snapshot_entries(self.pipeline_id, epoch, held)):
            raise ConfigurationError(f"stage {stage!r}: the state of {held!r} is RocksDB's, whose files a merge "
                                     f"does not renumber; {way}")
        sink = self.sinks.get(stage)
        if isinstance(sink, TransactionalFileSink):
            sink.previous_stage = members[-1]  # it takes over the folder the last member wrote
        elif sink is not None:
            raise ConfigurationError(f"sink {stage!r}: its exactly-once bookkeeping ({type(sink).__name__}) is kept "
                                     f"under {members[-1]!r}'s name, and only a file sink's is carried across a "
                                     f"merge yet; {way}")
        return source, held

    def _records_in_flight(self, stages: Sequence[str], epoch: int) -> str:
        """Reads only: which of ``stages`` ``epoch`` cut unaligned with data entries between its cursor and the
        barrier on an input (records a restore reads again from that channel), as ``"stage (channel), ..."``."""
        found = []
        for ack in self.store.acks(self.pipeline_id, epoch):
            if ack.stage not in stages or not ack.details.get("unaligned"):
                continue
            for channel, cursor in sorted(ack.cursors.items()):
                folder = self.layout.channel_fs(channel)
                ch = Channel.open(folder) if Channel.exists(folder) else None
                barrier = ch.find_barrier(epoch) if ch is not None else None
                if ch is None or barrier is None or any(not e.is_barrier for e in ch.entries(cursor, barrier)):
                    found.append(f"{ack.stage} ({channel})")
        return ", ".join(found)

    def _restore_facts(self) -> RestoreFacts:
        """The facts :func:`plan_restore` needs for this run's ``restore_from`` (read as the CLI reads them)."""
        situation = read_restore_facts(self.store, self.pipeline_id, self.restore_from, self.graph.stage_names,
                                       has_state=self._has_state, location=self.layout.fs.uri_of(self.pipeline_id))
        self._fork_source = situation.fork_source
        return replace(situation.facts, allow_dropped_state=self.allow_dropped_state,
                       renamed=tuple(self.renamed.items()),
                       identities=stage_identities(self.graph.stages),
                       sources=tuple(s.name for s in self.logical.stages if s.kind is StageKind.SOURCE))

    def _register(self) -> None:
        takeover = check_registrable(self.store, self.pipeline_id, takeover=self.takeover,
                                     stale_after=self.stale_after)
        self.store.register_pipeline(
            self.pipeline_id, stages=self.graph.stage_names, run_id=self.run_id,
            channels={c: self.layout.channel_uri(c) for c in self.graph.channels},
            storage_uri=self.storage_uri, takeover=takeover,
            config={"driver": "airflow_arroyo.runtime.driver", "checkpoint_uri": self.checkpoint_uri, "stages": {
                s.name: {"kind": s.kind.value, "inputs": list(s.inputs), "feedback": list(s.feedback),
                         "output": s.output, "uid": s.uid} for s in self.graph.stages}, "plan": self.plan.as_dict()},
        )

    # ------------------------------------------------------------------ fencing

    def _take_token(self) -> None:
        """Right after registering: this run's fencing token, which every write of the run carries (store
        writes, channel entries, caps, sink pre-commits and commits), so that they are refused once a newer
        run registers (docs/runtime.md, "Fencing")."""
        token = self.token = self.store.fencing_token(self.pipeline_id, self.run_id)
        self.snapshots.token = token
        for sink in self.sinks.values():
            sink.token = token
        self.gates.token = token
        log.info("pipeline=%s run=%s: registered as generation %s", self.pipeline_id, self.run_id, token.generation)

    def _fence_channels(self, epoch: int | None) -> None:
        """Before any stage runs: each channel records that this generation writes from where the restore cut
        it (right after barrier ``epoch``), or from 0 after a start over or on a fresh start (the channels are
        empty). From then on readers ignore whatever an older run, superseded but maybe still alive, appends
        there; its appends are refused. After the restore, not before it: a restore that fails must leave
        every older entry readable for the next attempt."""
        assert self.token is not None
        for c in self.graph.channels:
            folder = self.layout.channel_fs(c)
            if not Channel.exists(folder):
                continue
            channel = Channel.open(folder)
            if epoch is None or c in self._fresh_channels:
                position = 0
            else:
                barrier = channel.find_barrier(epoch)
                if barrier is None:
                    raise ConfigurationError(f"channel {c!r} has no barrier {epoch} after the restore of epoch {epoch}")
                position = barrier + 1
            channel.fence(self.token.generation, position)

    def _raise_if_superseded(self, what: str) -> None:
        """A failure of a run that a newer one superseded is that run's doing, not the user's: say so."""
        if self.token is None:
            return
        try:
            current = self.store.get_pipeline(self.pipeline_id)
        except ArroyoError:
            return
        if current.generation != self.token.generation:
            raise FencedError(self.pipeline_id, self.run_id, self.token.generation, by_run=current.run_id,
                              by_generation=current.generation, what=what)

    def _superseded(self, refused: FencedError) -> FencedError:
        """The refusal with the run that superseded this one named (storage refusals know only its
        generation)."""
        if refused.by_run is not None:
            return refused
        try:
            current = self.store.get_pipeline(self.pipeline_id)
        except ArroyoError:
            return refused
        out = FencedError(self.pipeline_id, self.run_id, refused.generation, by_run=current.run_id,
                          by_generation=current.generation, what=refused.what)
        out.__cause__ = refused
        return out

    # ------------------------------------------------------------------ restore

    def _clean_leftovers(self) -> None:
        """Remove what a killed run may have left half-written: snapshot temp files and checkpoint folders of
        an interrupted restore (never the live checkpoint, a snapshot object or the previous checkpoint)."""
        self.layout.fs.delete_tree(self.layout.snapshot_tmp_dir)
        for s in self.graph.stages:
            for folder in self.layout.stray_checkpoints(s.name):
                self.layout.checkpoint_fs.delete_tree(folder)

    def _step(self, name: str) -> None:
        self.step_times[name] = time.monotonic() - self._run_began
        log.debug("pipeline=%s run=%s: step %s done", self.pipeline_id, self.run_id, name)
        if self.on_step is not None:
            self.on_step(name)

    def _restore(self, epoch: int) -> None:
        """Restore ``epoch``.

        Rebuild every stage's checkpoint, cut every channel right after barrier ``epoch``, roll every
        exactly-once sink back to its cut. Three phases, in this order:

        1. *verify and prepare* (additive only): every channel holds barrier ``epoch``, every sink's cut is
           known, every stage's checkpoint is rebuilt in a new folder with each object's size and SHA-256
           verified. A failure or a kill here changes nothing: every epoch stays restorable.
        2. *commit* (:meth:`EpochStore.commit_restore`, one transaction, only while this run is the current
           one): the completed epochs after ``epoch`` become ``superseded`` and ``restored_from_epoch`` is
           recorded. From here ``epoch`` is the latest completed epoch.
        3. *roll forward* (destructive, each step idempotent): switch the checkpoint pointers, truncate the
           channels, roll the sinks back. A run killed here is finished by the next ``restore_from='latest'``,
           which picks ``epoch`` again and repeats the three phases.
        """
        t0 = time.monotonic()
        channels = {c: Channel.open(self.layout.channel_fs(c)) for c in self._carried_channels()}
        cut_positions = check_channels_have_barrier(channels, epoch)

        def truncate(_name: str, ch: Channel, position: int) -> None:
            ch.truncate_from(position)
            Channel.open(ch.uri).remove_orphans()

        prepared = self._restore_phases(
            epoch, channels, cut_positions, self._restored_sink_cuts(epoch),
            commit=lambda: self.store.commit_restore(self.pipeline_id, self.run_id, epoch),
            roll_channel=truncate, roll_step="truncated")
        log.info("pipeline=%s epoch=%s: restored %d stages (%d files) and truncated %d channels in %.1fs",
                 self.pipeline_id, epoch, len(prepared), sum(p.files for p in prepared), len(channels),
                 time.monotonic() - t0)

    def _restore_phases(self, epoch: int, channels: dict[str, Channel], cut_positions: dict[str, int],
                        sink_cuts: dict[str, int], *, commit: Callable[[], object],
                        roll_channel: Callable[[str, Channel, int], object], roll_step: str,
                        source: tuple[FileSystem, str] | None = None) -> list[PreparedRestore]:
        """The three phases of a restore once its channels and sinks are verified (:meth:`_restore`): prepare
        every stage's checkpoint (from ``source``'s objects for a fork), ``commit`` (the commit point; the
        prepared folders are discarded if it or a preparation fails), then roll forward: switch the
        checkpoints, ``roll_channel(name, channel, position)`` each channel to right after its barrier, roll
        the sinks back to their cuts. Each step is reported to ``on_step``."""
        self._check_public_output(epoch, sink_cuts)
        self._step("verified")
        prepared: list[PreparedRestore] = []
        try:
            if source is None:
                self._check_kafka_offsets(epoch)
            snapshot_of = self._snapshot_of()
            for s in self.graph.stages:
                if s.name in snapshot_of:
                    prepared.append(self.snapshots.prepare_restore(s.name, epoch, source=source,
                                                                   snapshot_stage=snapshot_of[s.name]))
                    self._step(f"prepared:{s.name}")
                    if s.name in self._splits:  # this run's own new folder, before the commit point
                        keep_state, channel_input = self._splits[s.name]
                        split_checkpoint(self.layout.checkpoint_fs, prepared[-1].folder, stage=s.name,
                                         keep_state=keep_state, channel_input=channel_input)
                        self._step(f"split:{s.name}")
                    if s.name in self._merges:  # the members' snapshots beside it, in this run's own folder
                        self._merge_into(prepared[-1].folder, s.name, epoch, source)
                        self._step(f"merged:{s.name}")
                    if s.name in self.rescale:  # this run's own new folder, before the commit point
                        rescale_checkpoint(self._session(), self.layout.checkpoint_fs, prepared[-1].folder,
                                           self.rescale[s.name], stage=s.name)
                        self._step(f"rescaled:{s.name}")
            commit()
        except UnrestorableEpochError as exc:
            self.snapshots.discard(prepared)
            if source is None:  # a fork point is the source pipeline's epoch, not this run's to mark
                why = f"its snapshot of stage {exc.stage!r}: {'; '.join(exc.problems)}" if exc.problems else str(exc)
                self.store.mark_unrestorable(self.pipeline_id, epoch, why, token=self.token)
            raise
        except BaseException:
            self.snapshots.discard(prepared)
            raise
        self._step("committed")
        for p in prepared:
            self.snapshots.commit_restore(p)
            self._step(f"switched:{p.stage}")
        for name, ch in channels.items():
            roll_channel(name, ch, cut_positions[name])
            self._step(f"{roll_step}:{name}")
        self._start_new_stages(cut_positions)
        for name, sink in self.sinks.items():
            sink.rollback_to(sink_cuts[name])
            self._step(f"rolled-back:{name}")
        self.gates.start_at(sink_cuts)
        self._sinks_committed = epoch
        self.restored_from_epoch = epoch
        self._step("restored")
        return prepared

    def _state_codec(self, checkpoint: str | None) -> str:
        """The state store codec a checkpoint's query runs with (Spark records it in its offset log's conf)."""
        key = "spark.sql.streaming.stateStore.compression.codec"
        if checkpoint is not None:
            logged = sorted((int(e.name) for e in self.layout.checkpoint_fs.list_dir(f"{checkpoint}/offsets")
                             if e.name.isdigit()), reverse=True)
            if logged:
                text = self.layout.checkpoint_fs.read_bytes(f"{checkpoint}/offsets/{logged[0]}").decode()
                conf = json.loads(text.split("\n")[1]).get("conf", {})
                if key in conf:
                    return str(conf[key])
        return str(self._session().conf.get(key, "lz4"))

    def _merge_into(self, folder: str, stage: str, epoch: int, source: tuple[FileSystem, str] | None) -> None:
        """Rebuild the source and stateful members' snapshots beside ``folder`` and merge them into it."""
        head, held = self._merges[stage]
        scratch = f"{folder}/_merge"
        try:
            parts = {m: self.snapshots.rebuild(m, epoch, f"{scratch}/{m}", source=source, snapshot_stage=m).folder
                     for m in dict.fromkeys(m for m in (head, held) if m is not None)}
            state = parts[held] if held is not None else None
            resume = merge_checkpoint(self.layout.checkpoint_fs, folder, stage=stage, source=parts[head], state=state,
                                      empty_delta=lambda: empty_delta_file(self._session(), self._state_codec(state)))
        finally:
            self.layout.checkpoint_fs.delete_tree(scratch)
        log.info("pipeline=%s: stage %r merged from epoch %d's queries (source %r, state %r): resumes after batch %d",
                 self.pipeline_id, stage, epoch, head, held, resume)

    # ------------------------------------------------------------------ upgrades: stages the epoch has no state of

    def _snapshot_of(self) -> dict[str, str]:
        """Each stage this restore rebuilds -> the epoch's stage whose snapshot it takes (itself unless renamed);
        a stage missing here is new in this code and starts with empty state."""
        if self._upgrade is None:
            return {name: name for name in self.graph.stage_names}
        return self._upgrade.snapshot_of()

    def _carried_channels(self) -> list[str]:
        """The channels a restore cuts at the epoch's barrier: those written by a restored stage. A restored stage
        reading a channel whose writer starts afresh is refused: its checkpoint's positions are into what the old
        writer wrote."""
        restored = self._snapshot_of()
        split = self._upgrade.across_fusion() if self._upgrade is not None else {}
        # a channel between stages split from one fused query is new: it starts empty at the cut
        inside = {c for c in self.graph.channels if (w := self.graph.writers.get(c)) in split
                  and all(split.get(r) == split[w] for r in self.graph.readers(c))}
        carried = [c for c in self.graph.channels if self.graph.writers.get(c) in restored and c not in inside]
        for s in self.graph.stages:
            fresh = [c for c in s.all_inputs if c not in carried and c not in inside]
            if s.name in restored and fresh:
                raise ConfigurationError(
                    f"stage {s.name!r} is restored but reads channel(s) {', '.join(fresh)}, whose writer starts "
                    "with empty state in this upgrade: its checkpoint's positions belong to what the old writer "
                    f"wrote. Start {s.name!r} afresh too (a new name, and allow_dropped_state=[{s.name!r}]), or "
                    "keep the writer's state (renamed=...)")
        missing = [c for c in carried if not Channel.exists(self.layout.channel_fs(c))]
        if missing:
            raise ConfigurationError(
                f"channel(s) {', '.join(missing)} of restored stage(s) "
                f"{', '.join(str(self.graph.writers[c]) for c in missing)} do not exist in this pipeline's storage: "
                "a renamed stage keeps its state, not its channel's name (channels are named after the stage that "
                "writes them); give it output='<old name>' to keep writing its channel")
        self._fresh_channels = set(self.graph.channels) - set(carried)
        return carried

    def _restored_sink_cuts(self, epoch: int) -> dict[str, int]:
        """Each exactly-once sink's cut in ``epoch``, by the snapshot it restores; -1 for a sink new in this code
        (nothing of the epoch is its output)."""
        snapshot_of = self._snapshot_of()
        restored = {name: snapshot_of[name] for name in self.sinks if name in snapshot_of}
        details = {a.stage: a.details for a in self.store.acks(self.pipeline_id, epoch)} if restored else {}
        cuts = sink_cuts(self.pipeline_id, epoch, restored.values(), details)
        return {name: cuts[restored[name]] if name in restored else -1 for name in self.sinks}

    def _start_new_stages(self, cut_positions: Mapping[str, int]) -> None:
        """After the commit point: a stage new in this code starts from an empty checkpoint, reading each carried
        input channel from right after the epoch's barrier; a channel it writes starts empty."""
        restored = self._snapshot_of()
        layout = self.layout
        for s in self.graph.stages:
            if s.name in restored:
                continue
            if layout.checkpoint_fs.exists(layout.checkpoint(s.name)):  # left by a stage of that name long ago
                empty = layout.new_checkpoint(s.name, 0)
                layout.checkpoint_fs.makedirs(empty)
                layout.switch_checkpoint(s.name, empty)
            self._channel_starts[s.name] = {c: cut_positions[c] for c in s.all_inputs if c in cut_positions}
            log.info("pipeline=%s: stage %r is new in this code: empty state, its inputs from the epoch's cut %s",
                     self.pipeline_id, s.name, self._channel_starts[s.name])
        for c in sorted(self._fresh_channels):
            folder = layout.channel_fs(c)
            if Channel.exists(folder):
                Channel.open(folder).reset()

    def _check_kafka_offsets(self, epoch: int) -> None:
        """Before the commit point: refuse an epoch whose Kafka source offsets point at records the topics no
        longer hold (:func:`~airflow_arroyo.runtime.kafka_offsets.lost_offsets`): restoring it would skip them."""
        if not self._kafka_sources:
            return
        for s in self.graph.stages:
            logs = sorted((int(e.rel_path.split("/")[1]), e.object_key)
                          for e in self.store.snapshot_entries(self.pipeline_id, epoch,
                                                               self._snapshot_of().get(s.name, s.name))
                          if re.fullmatch(r"offsets/\d+", e.rel_path))
            if not logs:
                continue
            text = self.snapshots.fs.read_bytes(object_path(self.pipeline_id, logs[-1][1])).decode()
            lost = lost_offsets(self._kafka_sources, kafka_offsets(text))
            if lost:
                problems = tuple(f"Kafka {x}" for x in lost)
                raise UnrestorableEpochError(
                    f"epoch {epoch} cannot be restored: stage {s.name!r} would resume reading Kafka from offsets the "
                    f"topics no longer hold: {'; '.join(map(str, lost))}; their retention deleted those records, "
                    "and restoring the epoch would skip them. Restore a later epoch, or start over (a new "
                    "pipeline id or storage folder) if losing them is acceptable; nothing was changed",
                    epoch=epoch, stage=s.name, problems=problems)

    def _check_public_output(self, epoch: int, sink_cuts: dict[str, int]) -> None:
        """Before the commit point: refuse a restore that would take back output a sink already made public and
        cannot take back (a Kafka topic), naming the sink and the epochs whose output is public."""
        for name, sink in self.sinks.items():
            public = sink.public_after(sink_cuts[name])
            if public is None:
                continue
            later = [e.epoch for e in self.store.list_epochs(self.pipeline_id, limit=10_000)
                     if e.epoch > epoch and e.outcome in (EpochState.COMPLETED, EpochState.SUPERSEDED)
                     and self._sink_cuts(e.epoch).get(name, public + 1) <= public]
            raise ConfigurationError(
                f"restoring epoch {epoch} would take back output sink {name!r} already made public "
                f"({sink.uri}): the output of epoch(s) {', '.join(map(str, sorted(later))) or '?'} (its batches "
                f"{sink_cuts[name] + 1}..{public}) is committed and readers may have acted on it. Restore epoch "
                f"{max(later, default=epoch)} or later, or allow the sink to emit that output again "
                "(KafkaTarget(allow_reemit=True))")

    def _restore_fork(self, source: PipelineRecord, epoch: int) -> None:
        """A fork's first run: restore ``epoch`` of ``source`` (the fork point) into this pipeline.

        The same three phases as :meth:`_restore`. *Verify and prepare*: every source channel holds barrier
        ``epoch``, every sink's cut is known (the source's acknowledgements), every stage's checkpoint is rebuilt
        from the source's snapshot objects, read where they are (shared, not copied: the fork's own first epoch
        snapshots its own copy). *Commit*: :meth:`EpochStore.commit_fork_restore` records the fork point as
        ``restored_from_epoch``. *Roll forward*: switch the checkpoint pointers, copy each source channel up to
        right after its barrier ``epoch`` into the fork's channel (same positions, so recorded offsets hold),
        roll the fork's sinks to their cut. Until the fork completes an epoch, a repeat does it all again.
        """
        t0 = time.monotonic()
        # only the source's storage URI is read (channels, snapshot objects), never its Spark checkpoints
        src = StorageLayout.at(source.storage_uri or self.storage_uri, source.pipeline_id)
        channels = {c: Channel.open(src.channel_fs(c)) for c in self.graph.channels}
        cut_positions = check_channels_have_barrier(channels, epoch)
        prepared = self._restore_phases(
            epoch, channels, cut_positions, self._sink_cuts(epoch, owner=source.pipeline_id),
            commit=lambda: self.store.commit_fork_restore(self.pipeline_id, self.run_id),
            roll_channel=lambda name, ch, position: ch.copy_to(self.layout.channel_fs(name), position),
            roll_step="copied", source=(src.fs, source.pipeline_id))
        log.info("pipeline=%s epoch=%s: restored the fork point from %s (%d stages, %d files, %d channels) in %.1fs",
                 self.pipeline_id, epoch, source.pipeline_id, len(prepared), sum(p.files for p in prepared),
                 len(channels), time.monotonic() - t0)

    def _start_over(self) -> None:
        """restore_from='latest' with no completed epoch: begin again from empty checkpoints and channels."""
        if not self._has_state():
            return
        layout = self.layout
        for s in self.graph.stages:
            if layout.checkpoint_fs.exists(layout.checkpoint(s.name)):
                empty = layout.new_checkpoint(s.name, 0)
                layout.checkpoint_fs.makedirs(empty)
                layout.switch_checkpoint(s.name, empty)
        for c in self.graph.channels:
            folder = self.layout.channel_fs(c)
            if Channel.exists(folder):
                # fresh checkpoints restart batch ids at 0: forget the writers' ids too (retention watermark)
                Channel.open(folder).reset()
        for sink in self.sinks.values():
            sink.rollback_to(-1)  # no epoch ever completed: nothing of it was committed
        self.store.supersede_gates(self.pipeline_id, after=0, token=self.token)  # their epochs are recomputed
        log.info("pipeline=%s: no completed epoch; fresh checkpoints and empty channels", self.pipeline_id)

    # ------------------------------------------------------------------ Spark

    def _session(self) -> SparkSession:
        if self._spark is None:
            from pyspark.sql import SparkSession

            self._spark = SparkSession.builder.appName(f"arroyo-{self.pipeline_id}").getOrCreate()
        spark = self._spark
        for k, v in DEFAULT_SQL_CONF.items():
            if spark.conf.get(k, None) in (None, "100"):
                spark.conf.set(k, v)
        return spark

    def _start_stages(self, spark: SparkSession) -> None:
        """Build every stage in topological order (a stage's input channels must exist, with their schema,
        before its readers are planned), start the channel stages downstream first so that they are
        ready when data comes, mark the pipeline running, then start the sources."""
        assert self._executor is not None
        last_cut = self.restored_from_epoch or 0
        frames = []
        for spec in self.graph.stages:
            for fb in spec.feedback:
                self._ensure_feedback_channel(spec.name, fb)
            runner = StageRunner(spec, layout=self.layout, store=self.store, snapshots=self.snapshots,
                                 executor=self._executor, last_cut_epoch=last_cut, commit_timeout=self.commit_timeout,
                                 channel_starts=self._channel_starts.get(spec.name),
                                 gated=True, sink=self.sinks.get(spec.name), token=self.token,
                                 alignment_timeout=self.alignment_timeout)
            try:
                df = runner.build(spark)  # runs the user's source read / transform
            except ArroyoError:
                raise
            except Exception as exc:
                raise StageBuildError(self.pipeline_id, spec.name, exc) from exc
            frames.append((runner, df))
            self.runners.append(runner)
        self._wire_backpressure()
        self._start_queries(spark, [(r, df) for r, df in reversed(frames) if r.kind is not StageKind.SOURCE])
        # The Spark application and its UI are reported before `running`: whoever waits for `running`
        # (the submit task and its "Spark UI" link) reads them at once.
        self.store.heartbeat(self.pipeline_id, self.run_id, spark_app_id=spark.sparkContext.applicationId,
                             spark_ui_url=spark.sparkContext.uiWebUrl, token=self.token)
        self._start_queries(spark, [(r, df) for r, df in frames if r.kind is StageKind.SOURCE])
        for runner in self.runners:
            runner.open_gate()
        self._step("queries-started")
        self._warm_up()
        self._warn_unbounded_sources()
        self._step("warm")
        self.store.set_pipeline_state(self.pipeline_id, PipelineState.RUNNING, run_id=self.run_id)

    def _warm_up(self) -> None:
        """Before `running` (no epoch can start before it): let every query complete its first micro-batch of this
        run, for at most ``warmup_timeout`` seconds. A query's first batch pays for planning and code generation,
        its state store and Python workers: seconds per stage, tens of seconds for a restored stateful stage, which
        the first epoch's barrier would otherwise wait for stage after stage. A stage with nothing to read (its
        upstream stages are warm, or it has none, and its query has had no data for a second, or for two of its
        triggers where they are slower) does not hold the others up: an idle input may never give it a batch. A stop
        asked through the store ends the wait."""
        t0 = time.monotonic()
        deadline = t0 + self.warmup_timeout
        beat = t0
        writers = {r.spec.output: r for r in self.runners if r.spec.output}
        idle_since: dict[str, float] = {}
        cold = [r for r in self.runners if not r.warm]
        while cold and time.monotonic() < deadline and not self._stop.is_set():
            self._check_queries()
            now = time.monotonic()
            if now - beat >= self.heartbeat_interval:
                record = self.store.heartbeat(self.pipeline_id, self.run_id)
                beat = now
                if record.stop_requested and self._stop_mode is None:  # the loop carries it out
                    self._stop_mode = StopMode(record.stop_requested)
                    self._stop.set()
            for r in cold:
                upstream = [writers[c] for c in r.spec.inputs if c in writers]
                status = r.query.status if r.query is not None else {}
                if (all(u.warm or u.name not in {c.name for c in cold} for u in upstream)
                        and not status.get("isDataAvailable") and not status.get("isTriggerActive")):
                    idle_since.setdefault(r.name, now)
                else:
                    idle_since.pop(r.name, None)
            # idle for a second, or two of its triggers where they are slower: a trigger that found no data yet
            cold = [r for r in cold if not r.warm
                    and now - idle_since.get(r.name, now) < max(1.0, 2 * trigger_interval(r.spec))]
            self._stop.wait(0.05)
        log.info("pipeline=%s: queries warmed up in %.1fs%s", self.pipeline_id, time.monotonic() - t0,
                 f" ({', '.join(r.name for r in cold)} ran no micro-batch yet)" if cold else "")

    def _warn_unbounded_sources(self) -> None:
        """Warn, once a run, for each source stage whose sources read without a read limit: under sustained
        overload its micro-batches, and the epochs that wait for them, would grow with the backlog."""
        for runner in self.runners:
            if runner.kind is not StageKind.SOURCE or runner.query is None:
                continue
            unbounded = unbounded_sources(query_read_limits(runner.query) or [])
            if unbounded:
                log.warning("%s", unbounded_source_warning(self.pipeline_id, runner.name, unbounded))

    def _wire_backpressure(self) -> None:
        """Bound each channel's unread backlog on aligned edges (never on a loop's feedback edge: a loop
        whose head waited for its tail and whose tail waited for its head would deadlock)."""
        if not self.max_backlog_entries:
            return
        for writer in self.runners:
            out = writer.output
            channel = writer.spec.output
            if out is None or channel is None:
                continue
            readers = [r for r in self.runners if channel in r.spec.inputs]
            if not readers:
                continue

            def backlog(out: Channel = out, channel: str = channel, readers: list[StageRunner] = readers) -> int:
                return out.end_position() - min(r.consumed.get(channel, 0) for r in readers)

            writer.set_backpressure(backlog, self.max_backlog_entries)

    def _start_queries(self, spark: SparkSession, stages: list[tuple[StageRunner, Any]], attempts: int = 6) -> None:
        """Start the queries of ``stages`` together and wait until each has initialized its sources (its first
        trigger ran, or its first micro-batch reached the gate). Each query initializes in its own stream
        thread, so together they take about as long as the slowest one instead of the sum (the channel stages
        wait at their gates until every query is up).

        Each Python data source starts a Python process that must connect back to the JVM within Spark's fixed
        10 s; on a busy machine several at once can miss it (importing pyspark alone takes seconds of CPU). A
        query that failed that way ran no batch and is safe to start again: those are started again one at a
        time, up to ``attempts`` times each. Any other failure is left to the loop, which reports it with its
        cause."""
        t0 = time.monotonic()
        again = self._start_together(spark, stages)
        for stage in again:
            for attempt in range(2, attempts + 1):
                log.warning("pipeline=%s stage=%s: a Python data source process did not connect back in time; "
                            "starting the query again, alone (attempt %d of %d)", self.pipeline_id, stage[0].name,
                            attempt, attempts)
                if not self._start_together(spark, [stage], retry=attempt < attempts):
                    break
        log.info("pipeline=%s: started %d queries (%s) in %.1fs", self.pipeline_id, len(stages),
                 ", ".join(r.name for r, _ in stages), time.monotonic() - t0)

    def _start_together(self, spark: SparkSession, stages: list[tuple[StageRunner, Any]], *, retry: bool = True,
                        timeout: float = 300.0) -> list[tuple[StageRunner, Any]]:
        """Start ``stages`` at once, wait for each to initialize; return those whose Python data source process
        did not connect back (when ``retry``)."""
        started = [(runner, df, runner.start(spark, df)) for runner, df in stages]
        deadline = time.monotonic() + timeout
        for runner, _df, query in started:
            while query.isActive and query.lastProgress is None and not runner.batch_started.is_set():
                if time.monotonic() > deadline:
                    raise ArroyoError(f"stage {runner.name!r}: its query did not initialize its sources in "
                                      f"{timeout:g}s")
                time.sleep(0.05)
        failed = []
        for runner, df, query in started:
            if query.isActive or not retry:
                continue
            error = query.exception()
            text = str(error) if error is not None else ""
            if "connect back" in text or "CANNOT_OPEN_SOCKET" in text:
                failed.append((runner, df))
        return failed

    def _ensure_feedback_channel(self, head: str, channel: str) -> None:
        """A loop's feedback channel is read before its writer is built: create it with the schema of the
        head's first aligned input (a loop feeds back records shaped like its input)."""
        folder = self.layout.channel_fs(channel)
        if Channel.exists(folder) and Channel.open(folder).schema is not None:
            return
        first = self.graph.stage(head).inputs[0]
        schema = Channel.open(self.layout.channel_fs(first)).spark_schema
        Channel.create(folder, schema=schema)

    def _close_sinks(self) -> None:
        """Let the sinks go of their clients once the run ended (a failure to close must not hide how it ended)."""
        for name, sink in self.sinks.items():
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001 - logged: the run's own outcome is what is raised
                log.warning("pipeline=%s: sink %s did not close cleanly: %s", self.pipeline_id, name, _cause(exc))

    def _stop_queries(self) -> list[str]:
        """Stop every query, the sinks' first; the causes of those whose stream thread still runs."""
        lingering = []
        for r in reversed(self.runners):
            try:
                r.stop(self.query_stop_grace)
            except QueryStillRunningError as exc:
                log.error("pipeline=%s: %s", self.pipeline_id, exc)
                lingering.append(str(exc))
            except Exception as exc:  # a query that cannot stop cleanly must not hide the real outcome
                log.warning("pipeline=%s stage=%s: stopping the query raised %s", self.pipeline_id, r.name, exc,
                            exc_info=True)
        return lingering

    def _mark_failed(self, cause: str) -> None:
        try:
            self.store.set_pipeline_state(self.pipeline_id, PipelineState.FAILED, run_id=self.run_id,
                                          failure_cause=cause[:4000])
        except ArroyoError as exc:
            log.error("pipeline=%s run=%s: could not record the failure (%s)", self.pipeline_id, self.run_id, exc)

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> DriverResult:
        try:
            return self._run_loop()
        except FencedError as exc:  # e.g. a source stage's barrier, appended from this thread, was refused
            raise self._superseded(exc) from None

    def _run_loop(self) -> DriverResult:
        """Every turn: watch the queries, follow the in-flight epoch (inject a new one at the sources, commit the
        sinks when one ended), cut idle sources, heartbeat, and ask :func:`decide_stop` what to do about a stop.
        Epoch starts and ends are announced by the database (LISTEN/NOTIFY): the in-flight epoch is read when one
        was, and at least every EPOCH_READ_FALLBACK seconds (every poll while the watch cannot listen); the
        stages are polled every poll_interval regardless."""
        spark = self._spark
        assert spark is not None
        turn = _LoopState(last_seen=self.restored_from_epoch or 0, app_id=spark.sparkContext.applicationId,
                          ui_url=spark.sparkContext.uiWebUrl)
        watch = self._epoch_watch = EpochWatch(self.store, self.pipeline_id, idle=self._stop.wait)
        changed = True
        while True:
            self._check_queries()
            self._follow_epochs(turn, changed)
            gate_stop = self.gates.advance(now=datetime.now(UTC), force=changed)  # a verdict is announced too
            if gate_stop is not None:
                return self._stop_for_gate(gate_stop)
            for r in self.runners:
                r.cut_if_idle()
            self._heartbeat_if_due(turn)
            decision = decide_stop(self._stop_facts(turn))
            if decision.action is not StopAction.RUN:
                ended = self._apply_stop(decision, turn)
                if ended is not None:
                    return ended
            changed = watch.wait(self.poll_interval)

    def _follow_epochs(self, turn: _LoopState, changed: bool) -> None:
        """Read the in-flight epoch when it may have changed; when it did, an epoch ended or started: commit what
        completed; hand an epoch of this run not seen yet to the stages (the sources inject it)."""
        if changed or time.monotonic() - turn.last_read >= EPOCH_READ_FALLBACK:
            turn.in_flight, turn.last_read = self.store.in_flight_epoch(self.pipeline_id), time.monotonic()
        in_flight = turn.in_flight
        current = in_flight.epoch if in_flight is not None else None
        if self.sinks and current != turn.previous_in_flight:
            self._commit_sinks()  # an epoch ended (completed or not): commit what completed
        if turn.previous_in_flight is not None and current != turn.previous_in_flight:
            self._release_memory()
        turn.previous_in_flight = current
        if in_flight is None or in_flight.epoch <= turn.last_seen or in_flight.run_id != self.run_id:
            return
        turn.last_seen = in_flight.epoch
        self._epochs_seen_count += 1
        self._epochs_seen.append(in_flight.epoch)
        if self.sinks:
            self._epochs_to_commit.append(in_flight.epoch)
        log.info("pipeline=%s epoch=%s: triggered%s; injecting at the sources", self.pipeline_id,
                 in_flight.epoch, " (final)" if in_flight.is_final else "")
        for r in self.runners:
            r.request_epoch(in_flight.epoch)

    def _release_memory(self) -> None:
        """An epoch ended: give back the native memory the driver's threads freed during it. glibc keeps it in its
        arenas otherwise, and the driver's RSS rises with nothing live in it."""
        if self.release_memory is None:
            return
        began = time.monotonic()
        self.release_memory()
        self.memory_releases += 1
        self.memory_release_seconds += time.monotonic() - began

    def _heartbeat_if_due(self, turn: _LoopState) -> None:
        """Heartbeat every ``heartbeat_interval``; the heartbeat's answer carries a stop asked through the store.
        After each, the JVM forgets the socket files Spark deleted (:class:`~airflow_arroyo.jvm.SocketPathPruner`)."""
        now = time.monotonic()
        if now - turn.last_heartbeat < self.heartbeat_interval:
            return
        try:
            record = self.store.heartbeat(self.pipeline_id, self.run_id, spark_app_id=turn.app_id,
                                          spark_ui_url=turn.ui_url, token=self.token)
        except FencedError as exc:
            raise self._superseded(exc) from None
        turn.last_heartbeat = now
        if self.socket_paths is not None:
            self.socket_paths.prune()
        if record.stop_requested and self._stop_mode is None:
            self._stop_mode = StopMode(record.stop_requested)
            self._stop.set()

    def _stop_facts(self, turn: _LoopState) -> StopFacts:
        """The facts of :func:`decide_stop`; the final epoch's state is read only while stopping gracefully."""
        mode = self._stop_mode if self._stop.is_set() else None
        state = None
        if mode is StopMode.GRACEFUL and turn.final_epoch is not None:
            state = self.store.get_epoch(self.pipeline_id, turn.final_epoch).state
        return StopFacts(mode=mode, stopping=turn.stopping, final_epoch=turn.final_epoch, final_state=state,
                         final_attempts=turn.final_attempts, final_deadline=turn.final_deadline,
                         now=time.monotonic())

    def _apply_stop(self, decision: StopDecision, turn: _LoopState) -> DriverResult | None:
        """Carry out :func:`decide_stop`'s decision; the run's result when the run ends."""
        if decision.mark_stopping:
            turn.stopping = True
            self.store.set_pipeline_state(self.pipeline_id, PipelineState.STOPPING, run_id=self.run_id)
            log.info("pipeline=%s: graceful stop: taking a final epoch", self.pipeline_id)
        action = decision.action
        if action is StopAction.STOP:
            return self._finish(decision.epoch)
        if action is StopAction.START_FINAL:
            epoch, deadline = self._try_final_epoch()
            if epoch is not None:
                turn.final_epoch, turn.final_deadline = epoch, deadline
                turn.final_attempts += 1
        elif action is StopAction.FINISH:
            log.info("pipeline=%s epoch=%s: final epoch completed; stopping", self.pipeline_id, decision.epoch)
            self._commit_sinks()
            return self._finish(decision.epoch)
        elif action is StopAction.GIVE_UP:
            log.error("pipeline=%s epoch=%s: %s", self.pipeline_id, decision.epoch, decision.reason)
            return self._finish(None, cause=decision.cause)
        elif action is StopAction.RETRY_FINAL:
            log.warning("pipeline=%s epoch=%s: %s", self.pipeline_id, decision.epoch, decision.reason)
            if decision.fail_epoch and decision.epoch is not None:
                self.store.fail_epoch(self.pipeline_id, decision.epoch, "final epoch timed out", token=self.token)
            turn.final_epoch = None
        return None  # RUN, WAIT_FINAL, or a final epoch asked for or forgotten: keep going

    def _sink_cuts(self, epoch: int, owner: str | None = None) -> dict[str, int]:
        """Each exactly-once sink's cut batch in ``epoch`` (from its acknowledgement; of pipeline ``owner`` for a
        fork point)."""
        if not self.sinks:
            return {}
        details = {a.stage: a.details for a in self.store.acks(owner or self.pipeline_id, epoch)}
        return sink_cuts(self.pipeline_id, epoch, self.sinks, details)

    def _sink_floors(self, epoch: int) -> dict[str, int]:
        """Each sink's cut in the oldest retained ``epoch``, below which no restore goes (what a trim may forget);
        -1 for a sink that epoch has no cut of (new since an upgrade: it keeps all it has)."""
        details = {a.stage: a.details for a in self.store.acks(self.pipeline_id, epoch)}
        present = [name for name in self.sinks if (details.get(name) or {}).get("batch_id") is not None]
        cuts = sink_cuts(self.pipeline_id, epoch, present, details)
        return {name: cuts.get(name, -1) for name in self.sinks}

    def _commit_sinks(self) -> None:
        """Second phase of the exactly-once sinks: commit every batch up to the cut of the newest completed
        epoch this run took part in (:func:`epoch_to_commit`); then let them forget what only a restore behind
        the oldest completed epoch could need (:func:`sinks_to_commit`)."""
        if not self.sinks:
            return
        done = self._sinks_committed
        states = {e: self.store.get_epoch(self.pipeline_id, e).state for e in self._epochs_to_commit if e > done}
        epoch = epoch_to_commit(done, self._epochs_to_commit, states)
        self._epochs_to_commit = epochs_still_to_commit(done, self._epochs_to_commit, states)  # drop ended ones
        if epoch is None:
            return
        cuts = self._sink_cuts(epoch)
        oldest = self.store.oldest_completed_epoch(self.pipeline_id)
        oldest_epoch = oldest.epoch if oldest is not None else None
        floors = self._sink_floors(oldest_epoch) if oldest_epoch is not None and oldest_epoch != epoch else None
        plan = sinks_to_commit(epoch, cuts, oldest_epoch, floors)
        self.gates.hold(epoch, {name: cut for name, cut in cuts.items() if name in self.gates})
        for commit in plan.commits:
            if commit.sink in self.gates:
                continue  # its output waits for a verdict (GateKeeper.advance commits it)
            sink = self.sinks[commit.sink]
            try:
                result = sink.commit_through(commit.batch)
            except FencedError as exc:
                raise self._superseded(exc) from None
            if result.files or result.rows:  # what Airflow turns into an Asset event (airflow_arroyo.assets)
                self.store.record_sink_commit(
                    self.pipeline_id, epoch, self._declared(commit.sink), uri=sink.uri, batch_id=commit.batch,
                    files=result.files, rows=result.rows, bytes_committed=result.bytes, run_id=self.run_id,
                    token=self.token, table_version=result.version)
        self._sinks_committed = epoch
        self._epochs_to_commit = [e for e in self._epochs_to_commit if e > epoch]
        for trim in plan.trims:
            self.sinks[trim.sink].trim_through(self.gates.trim_floor(trim.sink, trim.batch))

    def _stop_for_gate(self, stop: GateStop) -> DriverResult:
        """A gate stops the pipeline (``hold``'s limit, ``rollback_and_stop``): queries first, so nothing more is
        pre-committed; for ``rollback_and_stop`` every sink then goes back to the newest completed epoch before the
        failed one (the epoch the next ``restore_from='latest'`` restores)."""
        log.error("pipeline=%s: %s", self.pipeline_id, stop.cause)
        self._stop_queries()
        if stop.rollback_before is not None:
            floor = self.store.latest_completed_before(self.pipeline_id, stop.rollback_before)
            cuts = self._sink_cuts(floor.epoch) if floor is not None else dict.fromkeys(self.sinks, -1)
            for name, sink in self.sinks.items():
                try:
                    sink.rollback_to(cuts[name])
                except FencedError as exc:
                    raise self._superseded(exc) from None
            log.error("pipeline=%s: every sink rolled back to epoch %s", self.pipeline_id,
                      floor.epoch if floor is not None else "(none: to the start)")
        return self._finish(None, cause=stop.cause)

    def _try_final_epoch(self) -> tuple[int | None, float]:
        policy = CheckpointPolicy(interval=1.0, timeout=max(1.0, self.final_epoch_timeout))
        tick = self.store.trigger_tick(self.pipeline_id, policy, triggered_by="final-epoch", force=True,
                                       is_final=True)
        if tick.started is not None:
            return tick.started.epoch, time.monotonic() + self.final_epoch_timeout
        if tick.decision.action not in (TriggerAction.WAIT_IN_FLIGHT, TriggerAction.WAIT_CLEANUP,
                                        TriggerAction.EXPIRE):
            log.info("pipeline=%s: final epoch not started (%s)", self.pipeline_id, tick.decision.reason)
        return None, 0.0

    def _check_queries(self) -> None:
        for r in self.runners:
            if r.fenced is not None:  # superseded: stop now, and write nothing more (not even the failure)
                raise self._superseded(r.fenced)
        for r in self.runners:
            q = r.query
            if q is None or q.isActive:
                continue
            exc = q.exception()
            own = r.errors[-1] if r.errors else None  # what the stage's writer raised, in full
            if own is not None and (exc is None or type(own).__name__ == "Py4JJavaError"):
                detail = _cause(own)  # Spark got only its brief (stage.brief_java_error), or lost it
            elif exc is not None:
                detail = _cause(exc)
            else:
                detail = "the query stopped unexpectedly"
            self._raise_if_superseded(f"stage {r.name!r}")  # e.g. the new run's restore removed its files
            raise PipelineFailedError(self.pipeline_id, f"{self._stage_label(r.name)} failed: {detail}")

    def _stage_label(self, name: str) -> str:
        """How a failure names physical stage ``name``: a fused query lists the stages it runs."""
        group = next((g for g in self.plan.groups if g.name == name), None)
        fused = f" (fused: {', '.join(group.stages)})" if group is not None and len(group.stages) > 1 else ""
        return f"stage {name!r}{fused}"

    def _finish(self, final_epoch: int | None, cause: str | None = None) -> DriverResult:
        lingering = self._stop_queries()
        if lingering:  # not stopped: a successor must not take over while a query may still write
            raise PipelineFailedError(self.pipeline_id, "; ".join(lingering))
        record: PipelineRecord = self.store.set_pipeline_state(
            self.pipeline_id, PipelineState.STOPPED, run_id=self.run_id, failure_cause=cause)
        log.info("pipeline=%s run=%s: stopped (final epoch %s)", self.pipeline_id, self.run_id, final_epoch)
        return DriverResult(self.pipeline_id, self.run_id, record.state, self.restored_from_epoch, final_epoch,
                            list(self._epochs_seen), cause, self._epochs_seen_count)


#: The longest failure cause the store keeps (its columns' cut).
CAUSE_LIMIT = 4000

# A Python exception line ("KeyError: 'x'", "pyspark.errors.exceptions.captured.AnalysisException: ...") at the start
# of a line, as Python prints it at the end of a traceback; Java's own ("org.apache...", "Caused by: ...") do not count.
_PY_ERROR_LINE = re.compile(
    r"^(?!(?:org|java|javax|scala|py4j)\.)[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)(?::|$)")
_PY_FRAME_LINE = re.compile(r'^\s*File "[^"]+", line \d+, in ')
# A frame of py4j's or pyspark's own Python code: the plumbing between Spark and the user's function.
_LIBRARY_FRAME_LINE = re.compile(r'^\s*File "[^"]*[/\\](?:py4j|pyspark)[/\\][^"]*", line \d+, in ')
# A Spark error class opening a message ("[MALFORMED_RECORD_IN_PARSING.WITHOUT_SUGGESTION] Malformed ..."), at the
# start of a line or after the exception's type ("Caused by: org.apache.spark.SparkException: [...] ...").
_ERROR_CLASS = re.compile(r"(?:^|^(?:Caused by: )?[\w.$]+: |^: [\w.$]+: )(\[[A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*\] .*)")
# Where a message's continuation lines end: the next exception in the chain, a frame, the query's report.
_MESSAGE_END = re.compile(r"^(?:Caused by: |\s*File \"|=== |Traceback |\s*$|[\w.$]+(?:Error|Exception)\b)")
_LEAD_LIMIT = 2000


def _cause(exc: BaseException) -> str:
    """A failure cause for the store and the log, the user's error first, at most :data:`CAUSE_LIMIT` long.

    Spark reports a user's error in a stage (a UDF's, the ``foreachBatch`` writer's, a Spark error such as a
    malformed record under ``FAILFAST``) inside long Java and py4j traces: the user's error leads, then the
    trace without Java stack frames and py4j's own frames (:func:`_user_error_first`). An exception of our own
    keeps its message; any other keeps its type and traceback.
    """
    if isinstance(exc, ArroyoError):
        return str(exc)[:CAUSE_LIMIT]
    text = str(exc).strip()
    if type(exc).__module__.startswith(("pyspark.", "py4j.")):
        return _user_error_first(text or type(exc).__name__)
    trace = "".join(traceback.format_exception(exc)).rstrip()
    head = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return _fit(head[:_LEAD_LIMIT], trace.splitlines(), from_end=True)


def _user_error_first(text: str) -> str:
    r"""``text`` (a Spark error message) led by the user's error it carries, at most :data:`CAUSE_LIMIT` long.

    The user's error is the last Python exception line, with the frame that raised it (a UDF's or the
    ``foreachBatch`` writer's error), or else the deepest Spark error class and its whole message (a Spark error
    from inside the writer's batch reaches us as py4j's ``Py4JJavaError`` wrapping it). The message follows
    without Java stack frames (``	at ...``) and py4j's and pyspark's own Python frames; where it is too long,
    its end is cut, never the lead."""
    main, sep, query = text.partition("=== Streaming Query ===")
    lines = [ln for ln in main.rstrip().splitlines() if not ln.startswith(("\tat ", "\t... "))]
    body = _trim_library_frames(lines) + ([sep, *query.strip("\n").splitlines()] if sep else [])
    hits = [i for i, ln in enumerate(lines) if _PY_ERROR_LINE.match(ln)]
    if hits:
        last = hits[-1]
        lead = [lines[last].strip()]
        frames = [i for i in range(last) if _PY_FRAME_LINE.match(lines[i])]
        if frames:
            at = lines[frames[-1]].strip()
            code = lines[frames[-1] + 1].strip() if frames[-1] + 1 < last else ""
            lead.append(f"  raised at {at}" + (f": {code}" if code and not code.startswith("^") else ""))
        return _fit("\n".join(lead), ["", "Spark's message:", *body])
    classes = [(i, m.group(1)) for i, ln in enumerate(lines) if (m := _ERROR_CLASS.match(ln))]
    if not classes:
        return _fit("", body)
    first, message = classes[-1]
    more: list[str] = []
    for ln in lines[first + 1:]:
        if _MESSAGE_END.match(ln):
            break
        more.append(ln)
    return _fit("\n".join([message, *more])[:_LEAD_LIMIT], ["", "Spark's message:", *body])


def _trim_library_frames(lines: list[str]) -> list[str]:
    """``lines`` without py4j's and pyspark's own traceback frames (a frame's line and its code) and without
    Python's ``^^^`` markers."""
    kept: list[str] = []
    skipping = False
    for ln in lines:
        if _PY_FRAME_LINE.match(ln):
            skipping = bool(_LIBRARY_FRAME_LINE.match(ln))
            if not skipping:
                kept.append(ln)
            continue
        if skipping and ln.startswith("    "):
            continue
        skipping = False
        if ln.strip() and not ln.strip().strip("^~"):
            continue
        kept.append(ln)
    return kept


def _fit(lead: str, rest: list[str], *, from_end: bool = False) -> str:
    """``lead`` then as much of ``rest``'s lines as :data:`CAUSE_LIMIT` leaves room for: their start, marked as
    cut, or with ``from_end`` their end (a Python traceback ends with the frame that raised)."""
    text = "\n".join([lead, *rest]) if lead else "\n".join(rest)
    if len(text) <= CAUSE_LIMIT:
        return text
    marker = "... (cut)"
    room = CAUSE_LIMIT - len(lead) - len(marker) - 2
    if room <= 0:
        return lead[:CAUSE_LIMIT]
    tail = "\n".join(rest)
    if from_end:
        return f"{lead}\n{marker}\n{tail[-room:]}"
    return f"{lead}\n{tail[:room]}\n{marker}" if lead else f"{tail[:room]}\n{marker}"


def check_registrable(store: EpochStore, pipeline_id: str, *, takeover: bool = False,
                      stale_after: float = DEFAULT_STALE_AFTER) -> bool:
    """Read-only: may a new run of ``pipeline_id`` register now? Returns whether it must take over the current
    run (``takeover`` given, or that run is still registered/running/stopping but has not heartbeated for
    ``stale_after`` seconds: presumed dead). Raises :class:`ConcurrencyConflict` when a live run holds the
    pipeline. :meth:`EpochStore.register_pipeline`'s transaction stays the proof; this check lets the driver
    refuse before Spark starts."""
    if takeover:
        return True
    try:
        current = store.get_pipeline(pipeline_id)
    except UnknownPipelineError:
        return False
    if current.state.terminal:
        return False
    age = (store.db_now() - current.heartbeat_at).total_seconds() if current.heartbeat_at is not None else None
    if age is not None and age > stale_after:
        log.warning("pipeline=%s: run %s has not heartbeated for %.0fs; taking over", pipeline_id, current.run_id,
                    age)
        return True
    seen = f"last heartbeat {age:.0f}s ago" if age is not None else "no heartbeat yet"
    raise ConcurrencyConflict(
        f"pipeline {pipeline_id!r} is {current.state} (run {current.run_id!r}, {seen}): another driver runs it. "
        f"Stop that run first; if its driver is dead, pass --takeover (takeover=True), or start again once its "
        f"heartbeat is older than {stale_after:g}s (then it is taken over automatically)"
    )


def _parse_restore_from(value: RestoreFrom) -> RestoreFrom:
    if value is None or value == "latest":
        return value
    if isinstance(value, str):
        if value.lower() in ("", "none", "fresh"):
            return None
        if value.isdigit():
            return int(value)
        raise ConfigurationError(f"restore_from must be 'latest', an epoch number or None, got {value!r}")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    raise ConfigurationError(f"restore_from must be 'latest', an epoch number >= 1 or None, got {value!r}")


# --------------------------------------------------------------------------- command line


def load_pipeline(ref: str, kwargs: dict[str, Any] | None = None) -> Pipeline:
    """``module:attr`` -> a Pipeline (``attr`` is one, or a function returning one)."""
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigurationError(f"--pipeline must look like 'package.module:attr', got {ref!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(_import_error(ref, module_name, exc)) from exc
    except Exception as exc:  # the module's own code failed: say which module, not a traceback
        raise ConfigurationError(f"importing module {module_name!r} (--pipeline {ref!r}) failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise ConfigurationError(f"module {module_name!r} has no attribute {attr!r} (--pipeline {ref!r})")
    value = target(**(kwargs or {})) if callable(target) and not isinstance(target, Pipeline) else target
    if not isinstance(value, Pipeline):
        raise ConfigurationError(f"--pipeline {ref!r} gave a {type(value).__name__}, not a Pipeline")
    return value


#: Where a pipeline module must be for the driver to import it (docs/airflow.md, "Where a pipeline module lives").
PIPELINE_MODULE_HELP = (
    "the driver imports it from its own Python path where it runs, and the executors import it to run its "
    "functions: install it there as a package, ship it with spark-submit --py-files "
    "(SubmitPipelineOperator(spark_submit_kwargs={'py_files': 'my_pipelines.zip'})), or, on a local master "
    "only, keep it in the Airflow DAGs folder, which the submit operator puts on the driver's PYTHONPATH"
)


def _import_error(ref: str, module_name: str, exc: ImportError) -> str:
    """One line saying which module could not be imported, where the driver looked and how a module gets there."""
    missing = exc.name or ""
    parts = module_name.split(".")
    if missing and missing not in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}:
        return (f"importing module {module_name!r} (--pipeline {ref!r}) failed: {exc} (a module it imports: "
                f"install {missing.split('.')[0]!r} where the driver and executors run, or ship it with --py-files)")
    path = [p for p in sys.path if p]
    shown = ", ".join(path[:8]) + (f", ... ({len(path) - 8} more)" if len(path) > 8 else "")
    return (f"cannot import module {module_name!r} (--pipeline {ref!r}): {exc}; {PIPELINE_MODULE_HELP}; "
            f"the driver's sys.path: {shown}")


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="airflow_arroyo.runtime.driver",
                                     description="Run an airflow-arroyo pipeline in this Spark application.")
    parser.add_argument("--pipeline", required=True, help="module:attr of a Pipeline or a function returning one")
    parser.add_argument("--run-id", default=None, help="id of this run (default: generated)")
    parser.add_argument("--restore-from", default=None, help="'latest' or an epoch number (default: fresh start)")
    parser.add_argument("--storage-uri", default=os.environ.get("ARROYO_STORAGE_URI"),
                        help="root of channels and snapshots, and of checkpoints unless --checkpoint-uri is given "
                             "(default: $ARROYO_STORAGE_URI)")
    parser.add_argument("--checkpoint-uri", default=os.environ.get("ARROYO_CHECKPOINT_URI"),
                        help="root of Spark's streaming checkpoints, a Hadoop filesystem URI that pyarrow reads too "
                             "(default: $ARROYO_CHECKPOINT_URI, else the storage URI)")
    parser.add_argument("--takeover", action="store_true", help="supersede a run that is still registered")
    parser.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                        help="keyword argument for the pipeline function (JSON values allowed); repeatable")
    parser.add_argument("--master", default=None, help="Spark master when not run by spark-submit, e.g. local[2]")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="Spark conf when not run by spark-submit; repeatable")
    parser.add_argument("--poll-interval", type=float, default=0.15)
    parser.add_argument("--heartbeat-interval", type=float,
                        default=float(os.environ.get("ARROYO_HEARTBEAT_INTERVAL", "2.0")),
                        help="seconds between heartbeats (default: $ARROYO_HEARTBEAT_INTERVAL, else 2)")
    parser.add_argument("--warmup-timeout", type=float, default=DEFAULT_WARMUP_TIMEOUT,
                        help="seconds to let every query run its first micro-batch before epochs may start")
    parser.add_argument("--alignment-timeout", type=float, default=None, metavar="SECONDS",
                        help="seconds an epoch waits for its barriers at a stage reading a channel before the stage "
                             "cuts unaligned (0: at once; default: always aligned)")
    parser.add_argument("--allow-dropped-state", action="append", default=[], metavar="STAGE",
                        help="an upgrade: a stage of the restored epoch whose state this code drops (repeatable)")
    parser.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                        help="an upgrade: the epoch's stage OLD is this code's stage NEW (repeatable)")
    parser.add_argument("--rescale", action="append", default=[], metavar="STAGE=N",
                        help="a restore: rewrite the restored state of STAGE into N state partitions (repeatable)")
    parser.add_argument("--log-level", default=os.environ.get("ARROYO_LOG_LEVEL", "INFO"))
    return parser.parse_args(argv)


def _kv(items: list[str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"{what} must be KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def dsn_from_environment() -> str:
    """The epoch store DSN: ``ARROYO_DSN`` (local and client mode; a Kubernetes secret in K8s cluster
    mode), or the file ``ARROYO_DSN_FILE`` names (YARN cluster mode: shipped with ``--files``, in the
    container's working directory). Never a command-line argument."""
    dsn = os.environ.get("ARROYO_DSN", "").strip()
    if dsn:
        return dsn
    path = os.environ.get("ARROYO_DSN_FILE", "").strip()
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                dsn = f.read().strip()
        except OSError as exc:
            raise ConfigurationError(f"cannot read the epoch store DSN from ARROYO_DSN_FILE={path!r}: {exc}") from exc
        if dsn:
            return dsn
        raise ConfigurationError(f"ARROYO_DSN_FILE={path!r} is empty: it must hold the epoch store DSN")
    raise ConfigurationError(
        "set ARROYO_DSN to the epoch store DSN, or ARROYO_DSN_FILE to a file holding it "
        "(kept off the command line on purpose)"
    )


def main(argv: list[str] | None = None) -> int:
    """The driver's command line; the process's exit code (0 stopped, 1 failed, 2 bad configuration)."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(threadName)s: %(message)s")
    for noisy in ("py4j", "py4j.clientserver"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        dsn = dsn_from_environment()
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.storage_uri:
        print("error: give --storage-uri or set ARROYO_STORAGE_URI", file=sys.stderr)
        return 2
    try:
        pipeline = load_pipeline(args.pipeline, _kv(args.arg, "--arg"))
        pipeline.validate()
        validate_alignment_timeout(args.alignment_timeout)
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    store = EpochStore(dsn, application_name=f"arroyo-driver-{pipeline.pipeline_id}")
    log.info("pipeline=%s: epoch store %s, storage %s, checkpoints %s", pipeline.pipeline_id, redact_dsn(dsn),
             args.storage_uri, args.checkpoint_uri or args.storage_uri)
    try:  # before Spark starts (tens of seconds): the schema, and no live run holding the pipeline
        store.check_schema()
        check_registrable(store, pipeline.pipeline_id, takeover=args.takeover)
    except ArroyoError as exc:
        store.close()
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigurationError) else 1
    spark = None
    if args.master or args.conf:
        from pyspark.sql import SparkSession

        builder = SparkSession.builder.appName(f"arroyo-{pipeline.pipeline_id}")
        if args.master:
            builder = builder.master(args.master)
        confs = {k: str(v) for k, v in _kv(args.conf, "--conf").items()}
        # what the provider adds on this master, the user's values kept (airflow_arroyo.jvm.master_conf)
        confs.update(master_conf(str(args.master or ""), confs))
        for k, v in confs.items():
            builder = builder.config(k, v)
        spark = builder.getOrCreate()
    driver = PipelineDriver(pipeline, store, storage_uri=args.storage_uri, checkpoint_uri=args.checkpoint_uri,
                            run_id=args.run_id,
                            restore_from=args.restore_from, spark=spark, takeover=args.takeover,
                            poll_interval=args.poll_interval, heartbeat_interval=args.heartbeat_interval,
                            own_spark=True, warmup_timeout=args.warmup_timeout,
                            allow_dropped_state=args.allow_dropped_state,
                            renamed={k: str(v) for k, v in _kv(args.rename, "--rename").items()},
                            rescale={k: int(v) for k, v in _kv(args.rescale, "--rescale").items()},
                            alignment_timeout=args.alignment_timeout)

    def on_signal(signum: int, _frame: object) -> None:
        log.warning("pipeline=%s: signal %s: stopping immediately", pipeline.pipeline_id, signum)
        driver.request_stop("immediate")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        result = driver.run()
    except ConfigurationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ArroyoError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        store.close()
    print(json.dumps({"pipeline_id": result.pipeline_id, "run_id": result.run_id, "state": result.state.value,
                      "restored_from_epoch": result.restored_from_epoch, "final_epoch": result.final_epoch,
                      "failure_cause": result.failure_cause}))
    return 0 if result.failure_cause is None else 1


if __name__ == "__main__":
    sys.exit(main())
