"""The epoch store over PostgreSQL (psycopg2), synchronous API: :class:`EpochStore`, the facade of its parts.

The store's duties are parts of their own (Flink's checkpoint coordinator hands its duties to
collaborators the same way: ``CompletedCheckpointStore``, ``CheckpointIDCounter``,
``CheckpointFailureManager``), each a class over the one :class:`~airflow_arroyo.store._db.Database` they
share (connection pool, retry policy, transactions):

============================  ===================================================================
``store.schema``              :class:`~airflow_arroyo.store.schema.Schema`: migrations, the schema check
``store.pipelines``           :class:`~airflow_arroyo.store.pipelines.Pipelines`: runs, restore commit, fencing
``store.ticks``               :class:`~airflow_arroyo.store.ticks.Ticks`: the controller's ticks
``store.epochs``              :class:`~airflow_arroyo.store.epochs.Epochs`: epochs and acknowledgements
``store.pins``                :class:`~airflow_arroyo.store.pins.Pins`: pins and forks
``store.supervision``         :class:`~airflow_arroyo.store.supervision.Supervision`: failures and restarts
``store.objects``             :class:`~airflow_arroyo.store.objects.Objects`: snapshot objects, scrub results
``store.cleanup``             :class:`~airflow_arroyo.store.cleanup.Cleanup`: cleanup lease, pruning, compaction
``store.sinks``               :class:`~airflow_arroyo.store.sink_commits.SinkCommits`: sink commit records
``store.gates``               :class:`~airflow_arroyo.store.gates.Gates`: commit gates and their verdicts
``store.shadows``             :class:`~airflow_arroyo.store.shadows.Shadows`: shadow runs
============================  ===================================================================

Every operation of a part is also a method of :class:`EpochStore` of the same name, signature and
docstring (a one-line delegate): the API callers use. Every state change that matters for the protocol
takes the pipeline's row lock first (``SELECT ... FOR UPDATE`` on ``arroyo_pipelines``), so that
triggering, the cleanup lease and pruning of one pipeline are serialised and the database's history is in
commit order.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypeVar

from psycopg2.extensions import connection as PgConnection

from airflow_arroyo.core.epochs import TriggerDecision
from airflow_arroyo.store._db import Database, OnDatabase, PgCursor, redact_dsn
from airflow_arroyo.store._pool import ConnectionPool
from airflow_arroyo.store.cleanup import Cleanup
from airflow_arroyo.store.epochs import Epochs
from airflow_arroyo.store.gates import Gates
from airflow_arroyo.store.objects import Objects
from airflow_arroyo.store.pins import Pins
from airflow_arroyo.store.pipelines import Pipelines
from airflow_arroyo.store.schema import Schema
from airflow_arroyo.store.shadows import Shadows
from airflow_arroyo.store.sink_commits import SinkCommits
from airflow_arroyo.store.supervision import Supervision
from airflow_arroyo.store.ticks import Ticks

__all__ = ["EpochStore", "TriggerDecision", "redact_dsn"]

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


def _via(part: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[EpochStore, P], R]:
    """The store's method that calls the method of that name of its part ``part`` (``method``: its name,
    signature and docstring)."""
    name = method.__name__

    @functools.wraps(method)
    def delegate(self: EpochStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        result: R = getattr(getattr(self, part), name)(*args, **kwargs)
        return result

    delegate.__qualname__ = f"EpochStore.{name}"
    return delegate


class EpochStore(OnDatabase):
    """Synchronous epoch store API. Thread-safe; holds a small connection pool that its parts share."""

    def __init__(self, dsn: str, *, max_connections: int = 8, retry_seconds: float = 60.0,
                 application_name: str = "airflow-arroyo") -> None:
        self._db = db = Database(dsn, max_connections=max_connections, retry_seconds=retry_seconds,
                                 application_name=application_name)
        self.schema = Schema(db)
        self.pipelines = Pipelines(db)
        self.ticks = Ticks(db)
        self.epochs = Epochs(db)
        self.pins = Pins(db, self.epochs)
        self.supervision = Supervision(db)
        self.objects = Objects(db)
        self.cleanup = Cleanup(db)
        self.sinks = SinkCommits(db)
        self.gates = Gates(db)
        self.shadows = Shadows(db)
        # helpers built on this store for one event loop each (the async tick coalescer, the listener)
        self._loop_helpers: dict[tuple[object, str], Any] = {}
        self._loop_helpers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EpochStore({redact_dsn(self.dsn)!r})"

    @property
    def _closed(self) -> bool:
        return self._db.closed

    @property
    def _pool(self) -> ConnectionPool:
        return self._db.pool

    def close(self) -> None:
        if not self._db.closed:
            self._db.close()
            with self._loop_helpers_lock:
                helpers, self._loop_helpers = list(self._loop_helpers.values()), {}
            for helper in helpers:
                helper.close()

    def loop_helper(self, loop: Any, name: str, factory: Callable[[], T]) -> T:
        """The ``name`` helper of this store for event loop ``loop`` (made by ``factory`` once).
        Helpers of loops that have closed are closed and forgotten; all are closed with the store."""
        with self._loop_helpers_lock:
            stale = [key for key in self._loop_helpers if key[0].is_closed()]  # type: ignore[attr-defined]
            dead = [self._loop_helpers.pop(key) for key in stale]
            helper: T | None = self._loop_helpers.get((loop, name))
            if helper is None:
                helper = self._loop_helpers[(loop, name)] = factory()
        for old in dead:
            old.close()
        return helper

    # ------------------------------------------------------------------ plumbing

    def connect(self) -> PgConnection:
        """A new connection with the store's settings (the pool's, and a listener's of its own)."""
        return self._db.connect()

    def _connection(self) -> AbstractContextManager[PgConnection]:
        return self._db.connection()

    def _tx(self, fn: Callable[[PgCursor], T]) -> T:
        """Run ``fn`` in one transaction, retried as a whole on transient errors."""
        return self._db.tx(fn)

    def db_now(self) -> datetime:
        """The database's clock."""
        return self._db.now()

    # ------------------------------------------------------------------ schema: store.schema

    migrate = _via("schema", Schema.migrate)
    check_schema = _via("schema", Schema.check_schema)
    schema_version = _via("schema", Schema.schema_version)

    # ------------------------------------------------------------------ pipelines, runs, fencing: store.pipelines

    fencing_token = _via("pipelines", Pipelines.fencing_token)
    register_pipeline = _via("pipelines", Pipelines.register_pipeline)
    commit_restore = _via("pipelines", Pipelines.commit_restore)
    fail_run = _via("pipelines", Pipelines.fail_run)
    set_pipeline_state = _via("pipelines", Pipelines.set_pipeline_state)
    heartbeat = _via("pipelines", Pipelines.heartbeat)
    request_stop = _via("pipelines", Pipelines.request_stop)
    record_checkpoint_interval = _via("pipelines", Pipelines.record_checkpoint_interval)
    get_pipeline = _via("pipelines", Pipelines.get_pipeline)
    list_pipelines = _via("pipelines", Pipelines.list_pipelines)

    # ------------------------------------------------------------------ the controller's ticks: store.ticks

    trigger_tick = _via("ticks", Ticks.trigger_tick)
    trigger_ticks = _via("ticks", Ticks.trigger_ticks)

    # ------------------------------------------------------------------ epochs and acknowledgements: store.epochs

    get_epoch = _via("epochs", Epochs.get_epoch)
    list_epochs = _via("epochs", Epochs.list_epochs)
    in_flight_epoch = _via("epochs", Epochs.in_flight_epoch)
    latest_completed_epoch = _via("epochs", Epochs.latest_completed_epoch)
    oldest_completed_epoch = _via("epochs", Epochs.oldest_completed_epoch)
    unpruned_epochs = _via("epochs", Epochs.unpruned_epochs)
    mark_unrestorable = _via("epochs", Epochs.mark_unrestorable)
    acknowledge = _via("epochs", Epochs.acknowledge)
    ack_epoch = _via("epochs", Epochs.ack_epoch)
    fail_epoch = _via("epochs", Epochs.fail_epoch)
    acks = _via("epochs", Epochs.acks)

    # ------------------------------------------------------------------ pins and forks: store.pins

    check_pin_label = staticmethod(Pins.check_pin_label)
    pin_epoch = _via("pins", Pins.pin_epoch)
    pin_final_epoch = _via("pins", Pins.pin_final_epoch)
    unpin_epoch = _via("pins", Pins.unpin_epoch)
    waiting_forks = _via("pins", Pins.waiting_forks)
    forks_of = _via("pins", Pins.forks_of)
    fork_pipeline = _via("pins", Pins.fork_pipeline)
    commit_fork_restore = _via("pins", Pins.commit_fork_restore)

    # ------------------------------------------------------------------ supervision: store.supervision

    supervise = _via("supervision", Supervision.supervise)
    record_failure = _via("supervision", Supervision.record_failure)
    expire_restart = _via("supervision", Supervision.expire_restart)
    claim_restart = _via("supervision", Supervision.claim_restart)
    record_restart = _via("supervision", Supervision.record_restart)
    end_supervision = _via("supervision", Supervision.end_supervision)
    restarts = _via("supervision", Supervision.restarts)
    restart_counts = _via("supervision", Supervision.restart_counts)

    # ------------------------------------------------------------------ snapshot objects and scrub: store.objects

    known_objects = _via("objects", Objects.known_objects)
    record_snapshot = _via("objects", Objects.record_snapshot)
    snapshot_entries = _via("objects", Objects.snapshot_entries)
    objects_to_verify = _via("objects", Objects.objects_to_verify)
    record_verification = _via("objects", Objects.record_verification)
    damaged_objects = _via("objects", Objects.damaged_objects)

    # ---------------------------------------------------------------- cleanup lease, pruning, compaction: store.cleanup

    acquire_cleanup_lock = _via("cleanup", Cleanup.acquire_cleanup_lock)
    renew_cleanup_lock = _via("cleanup", Cleanup.renew_cleanup_lock)
    release_cleanup_lock = _via("cleanup", Cleanup.release_cleanup_lock)
    cleanup_lock = _via("cleanup", Cleanup.cleanup_lock)
    list_cleanup_runs = _via("cleanup", Cleanup.list_cleanup_runs)
    begin_prune = _via("cleanup", Cleanup.begin_prune)
    finish_prune = _via("cleanup", Cleanup.finish_prune)
    begin_compaction = _via("cleanup", Cleanup.begin_compaction)
    compact_batch = _via("cleanup", Cleanup.compact_batch)

    # ------------------------------------------------------------------ sink commits: store.sinks

    record_sink_commit = _via("sinks", SinkCommits.record_sink_commit)
    sink_commits = _via("sinks", SinkCommits.sink_commits)
    latest_sink_commit = _via("sinks", SinkCommits.latest_sink_commit)

    # ------------------------------------------------------------------ commit gates: store.gates

    open_gate = _via("gates", Gates.open_gate)
    get_gate = _via("gates", Gates.get_gate)
    list_gates = _via("gates", Gates.list_gates)
    open_gates = _via("gates", Gates.open_gates)
    decide_gate = _via("gates", Gates.decide_gate)
    time_out_gate = _via("gates", Gates.time_out_gate)
    close_gate = _via("gates", Gates.close_gate)
    supersede_gates = _via("gates", Gates.supersede_gates)
    gate_blocker = _via("gates", Gates.gate_blocker)
    retention_floor = _via("gates", Gates.retention_floor)
    latest_completed_before = _via("gates", Gates.latest_completed_before)

    # ------------------------------------------------------------------ shadow runs: store.shadows

    record_shadow = _via("shadows", Shadows.record_shadow)
    get_shadow = _via("shadows", Shadows.get_shadow)
    shadows_of = _via("shadows", Shadows.shadows_of)
    end_shadow = _via("shadows", Shadows.end_shadow)
