"""The epoch store over PostgreSQL (psycopg2), synchronous API.

Every state change that matters for the protocol takes the pipeline's row lock first
(``SELECT ... FOR UPDATE`` on ``arroyo_pipelines``), so that triggering, the cleanup lease and
pruning of one pipeline are serialised and the database's history is in commit order.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

import psycopg2
import psycopg2.extras
from psycopg2.extensions import connection as PgConnection
from psycopg2.extensions import cursor as PgRawCursor

from airflow_arroyo.epochs import (
    EPOCH_TRANSITIONS,
    CheckpointPolicy,
    CleanupLease,
    EpochState,
    PipelineState,
    TriggerAction,
    TriggerDecision,
    TriggerFacts,
    consecutive_failures,
    decide_trigger,
    validate_pipeline_id,
)
from airflow_arroyo.exceptions import (
    ArroyoError,
    CleanupLockHeld,
    ConcurrencyConflict,
    ConfigurationError,
    LockLostError,
    StoreError,
    TransientStoreError,
    UnknownEpochError,
    UnknownPipelineError,
)
from airflow_arroyo.store._db import Database, PgCursor, dict_rows, one, positive_seconds, redact_dsn
from airflow_arroyo.store._pool import ConnectionPool
from airflow_arroyo.store._prepared import Prepared, execute_prepared
from airflow_arroyo.store._transitions import transition
from airflow_arroyo.store.pipelines import Pipelines, check_token, lock_pipeline, read_pipeline
from airflow_arroyo.store.records import (
    AckRecord,
    CleanupLockRecord,
    CleanupRunRecord,
    CompactionCut,
    EpochRecord,
    FencingToken,
    ObjectRecord,
    PipelineRecord,
    PrunePlan,
    RestartRecord,
    SnapshotEntry,
    TickRequest,
    TickResult,
    epoch_columns,
    from_row,
)
from airflow_arroyo.store.schema import Schema
from airflow_arroyo.store.sink_commits import SinkCommits
from airflow_arroyo.supervision import PastFailure, RestartDecision, SupervisionState, is_run_of, unrestorable_latest

_SUPERVISING = (SupervisionState.WATCHING.value, SupervisionState.RESTARTING.value)

log = logging.getLogger(__name__)

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

_EPOCH_COLS = epoch_columns()
#: The longest pin label (migration 0008 checks the same bound).
PIN_LABEL_MAX = 200
# The batch's pipeline row locks: waiting for them, or skipping rows another transaction holds.
_LOCK_SQL = "SELECT * FROM arroyo_pipelines WHERE pipeline_id = ANY($1) ORDER BY pipeline_id FOR UPDATE"
_LOCK_PIPELINES = Prepared("arroyo_lock_pipelines", ("text[]",), _LOCK_SQL)
# A tick batch's locks read only the columns a decision reads (a whole row decoded its JSON columns every tick).
_TICK_LOCK_SQL = ("SELECT pipeline_id, state, last_epoch, stop_requested, heartbeat_at FROM arroyo_pipelines"
                  " WHERE pipeline_id = ANY($1) ORDER BY pipeline_id FOR UPDATE")
_TICK_LOCK = Prepared("arroyo_tick_lock", ("text[]",), _TICK_LOCK_SQL)
_TICK_LOCK_SKIP = Prepared("arroyo_tick_lock_skip", ("text[]",), _TICK_LOCK_SQL + " SKIP LOCKED")
# Every locked pipeline's tick facts (see EpochStore._tick_facts), prepared once per connection.
_TICK_FACTS = Prepared(
    "arroyo_tick_facts", ("text[]", "int[]"),
    "SELECT r.pipeline_id, clock_timestamp() AS now, f.epoch AS in_flight,"
    " f.timeout_at AS in_flight_timeout_at,"
    " (SELECT max(e.triggered_at) FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id)"
    "   AS last_triggered_at,"
    " (SELECT e.ended_at FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id AND e.ended_at IS NOT NULL"
    "   ORDER BY e.epoch DESC LIMIT 1) AS last_ended_at,"
    " l.holder, l.expires_at,"
    " ARRAY(SELECT e.state FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id"
    "   ORDER BY e.epoch DESC LIMIT r.k) AS recent,"
    " ARRAY(SELECT e.epoch FROM arroyo_epochs e WHERE e.pipeline_id = r.pipeline_id"
    "   ORDER BY e.epoch DESC LIMIT r.k) AS recent_epochs"
    " FROM unnest($1, $2) AS r(pipeline_id, k)"
    " LEFT JOIN arroyo_epochs f ON f.pipeline_id = r.pipeline_id AND f.state = 'triggered' AND f.pipeline_id = ANY($1)"
    " LEFT JOIN arroyo_cleanup_locks l ON l.pipeline_id = r.pipeline_id AND l.expires_at > clock_timestamp()"
    "   AND l.pipeline_id = ANY($1)",
)

# Every START of a batch in one statement, moving the pipelines' last_epoch (see EpochStore._start_epochs).
_START_EPOCHS = Prepared(
    "arroyo_start_epochs", ("text[]", "bigint[]", "boolean[]", "text[]", "float8[]", "boolean[]"),
    "WITH s AS (SELECT * FROM unnest($1, $2, $3, $4, $5, $6)"  # noqa: S608
    "   AS s(pipeline_id, epoch, is_final, triggered_by, timeout_s, self_contained)),"
    f" ins AS (INSERT INTO arroyo_epochs ({_EPOCH_COLS})"
    "   SELECT s.pipeline_id, s.epoch, 'triggered', p.run_id, p.stages, s.is_final, s.triggered_by,"
    "   clock_timestamp(), clock_timestamp() + make_interval(secs => s.timeout_s),"
    "   NULL, NULL, NULL, NULL, NULL, NULL, s.self_contained, NULL, NULL, NULL, NULL"
    "   FROM s JOIN arroyo_pipelines p ON p.pipeline_id = s.pipeline_id AND p.pipeline_id = ANY($1)"
    "   ORDER BY s.pipeline_id"
    f"   RETURNING {_EPOCH_COLS}),"
    " upd AS (UPDATE arroyo_pipelines p SET last_epoch = ins.epoch FROM ins"
    "   WHERE p.pipeline_id = ins.pipeline_id AND p.pipeline_id = ANY($1))"
    " SELECT * FROM ins",
)


def _via(part: str, method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[EpochStore, P], R]:
    """The store's method that calls ``method`` of its part ``part``: same name, signature and docstring."""

    @functools.wraps(method)
    def delegate(self: EpochStore, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return method(getattr(self, part), *args, **kwargs)

    delegate.__qualname__ = f"EpochStore.{method.__name__}"
    return delegate



class EpochStore:
    """Synchronous epoch store API. Thread-safe; holds a small connection pool.

    The store's duties are parts of their own over one shared database (pool, retries): ``schema``,
    ``pipelines`` (runs, fencing), ``sinks`` (sink commits), ... Every operation is also a method of the store
    itself, the API callers use; new code may call the part.
    """

    def __init__(self, dsn: str, *, max_connections: int = 8, retry_seconds: float = 60.0,
                 application_name: str = "airflow-arroyo") -> None:
        self._db = db = Database(dsn, max_connections=max_connections, retry_seconds=retry_seconds,
                                 application_name=application_name)
        self.schema = Schema(db)
        self.pipelines = Pipelines(db)
        self.sinks = SinkCommits(db)
        # helpers built on this store for one event loop each (the async tick coalescer, the listener)
        self._loop_helpers: dict[tuple[object, str], Any] = {}
        self._loop_helpers_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EpochStore({redact_dsn(self.dsn)!r})"

    @property
    def dsn(self) -> str:
        return self._db.dsn

    @property
    def retry_seconds(self) -> float:
        return self._db.retry_seconds

    @property
    def application_name(self) -> str:
        return self._db.application_name

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

    # ------------------------------------------------------------------ sink commits: store.sinks

    record_sink_commit = _via("sinks", SinkCommits.record_sink_commit)
    sink_commits = _via("sinks", SinkCommits.sink_commits)
    latest_sink_commit = _via("sinks", SinkCommits.latest_sink_commit)

    def commit_fork_restore(self, pipeline_id: str, run_id: str) -> PipelineRecord:
        """The commit point of a fork's first restore (run ``run_id`` restores the fork point, an epoch of
        another pipeline): under both pipelines' row locks, refused (``ConcurrencyConflict``) unless ``run_id``
        is the fork's current run, still ``registered``; refused (``ConfigurationError``) unless the fork still
        has no completed epoch of its own and its fork point is still completed in the source. Records
        ``restored_from_epoch`` (the fork point); no epoch changes: the source's are not the fork's to
        supersede. Repeatable until the fork completes an epoch."""

        def tx(cur: PgCursor) -> PipelineRecord:
            current = read_pipeline(cur, pipeline_id)
            source, epoch = current.forked_from_pipeline, current.forked_from_epoch
            if source is None or epoch is None:
                raise ConfigurationError(f"pipeline {pipeline_id!r} is not a fork; nothing was changed")
            execute_prepared(cur, _LOCK_PIPELINES, (sorted([pipeline_id, source]),))
            rows = {r["pipeline_id"]: r for r in cur.fetchall()}
            fork = rows[pipeline_id]
            if fork["run_id"] != run_id or fork["state"] != PipelineState.REGISTERED.value:
                raise ConcurrencyConflict(
                    f"run {run_id!r} of pipeline {pipeline_id!r} cannot commit its restore of its fork point: the "
                    f"pipeline's current run is {fork['run_id']!r} ({fork['state']}); nothing was changed"
                )
            if pipeline_id not in self._waiting_forks(cur, source, epoch):
                raise ConfigurationError(f"fork {pipeline_id!r} has completed epochs of its own: restore one of "
                                         "them (restore_from='latest'); nothing was changed")
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s", (source, epoch))
            row = cur.fetchone()
            if row is None or row["state"] != EpochState.COMPLETED.value:
                raise ConfigurationError(
                    f"the fork point of {pipeline_id!r}, epoch {epoch} of {source!r}, is "
                    f"{row['state'] if row else 'gone'}, no longer completed (was it unpinned with --force and "
                    "pruned?); nothing was changed: fork again from a completed epoch"
                )
            cur.execute("UPDATE arroyo_pipelines SET restored_from_epoch = %s, updated_at = now()"
                        " WHERE pipeline_id = %s RETURNING *", (epoch, pipeline_id))
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

    # ------------------------------------------------------------------ triggering

    def trigger_tick(self, pipeline_id: str, policy: CheckpointPolicy, *, triggered_by: str = "trigger",
                     force: bool = False, is_final: bool = False, watch: Iterable[int] = (),
                     self_contained: bool = False) -> TickResult:
        """One decision of the checkpoint controller, applied atomically under the pipeline's row lock.

        Reads the facts, asks :func:`decide_trigger`, and applies START (insert epoch n+1) or
        EXPIRE (mark the in-flight epoch expired). ``force`` ignores the schedule (a final epoch on
        a graceful stop, a manual checkpoint) but never the one-in-flight rule or the cleanup lock.
        ``watch``: epoch numbers the caller saw in flight; those that have ended come back in
        ``TickResult.ended`` (saves the controller a transaction per epoch to report its end).
        ``self_contained``: an epoch started by this tick snapshots its own copy of every object.
        A batch of one of :meth:`trigger_ticks`.
        """
        request = TickRequest(pipeline_id, policy, triggered_by=triggered_by, force=force, is_final=is_final,
                              watch=tuple(watch), self_contained=self_contained)
        result = None
        for _ in range(3):
            # None only when the pipeline was registered between the batch's lock and its existence check
            # (its row was not there to lock yet): tick again, now that it is
            result = self.trigger_ticks([request])[0]
            if result is not None:
                break
        if isinstance(result, BaseException):
            raise result
        if result is None:
            raise TransientStoreError(f"pipeline {pipeline_id!r} kept changing under the tick; try again")
        return result

    def trigger_ticks(self, requests: Sequence[TickRequest]) -> list[TickResult | ArroyoError | None]:
        """Many pipelines' ticks in ONE transaction (a triggerer's due ticks, coalesced).

        Each pipeline is decided exactly as :meth:`trigger_tick` decides it, under its own row lock
        (taken in pipeline-id order, so two batches never deadlock), by :func:`decide_trigger` over
        facts read after every lock is held; the partial unique index still allows one in-flight
        epoch per pipeline whoever inserts. The round trips are per batch, not per pipeline: lock,
        facts, one INSERT for every START, one UPDATE for every EXPIRE, commit.

        Returns one entry per request, in order: its :class:`TickResult`; an :class:`ArroyoError`
        for that pipeline alone (:class:`UnknownPipelineError`, an epoch that vanished under us); or
        ``None`` for a ``skip_if_locked`` request whose row another transaction held. An error of the
        whole transaction is raised (transient ones after the store's retries).
        """
        if len({r.pipeline_id for r in requests}) != len(requests):
            raise ConfigurationError("trigger_ticks: a pipeline may appear once per batch; tick it again after")
        if not requests:
            return []
        def tx(cur: PgCursor) -> list[TickResult | ArroyoError | None]:
            with cur.connection.cursor() as raw:  # the batch's own statements: rows built by dict_rows
                return self._ticks(cur, raw, requests)

        return self._db.tx(tx)

    def _ticks(self, cur: PgCursor, raw: PgRawCursor, requests: Sequence[TickRequest]
               ) -> list[TickResult | ArroyoError | None]:
        out: list[TickResult | ArroyoError | None] = [None] * len(requests)
        wait = sorted(r.pipeline_id for r in requests if not r.skip_if_locked)
        skip = sorted(r.pipeline_id for r in requests if r.skip_if_locked)
        pipes: dict[str, dict[str, Any]] = {}
        # Blocking locks first, in id order, while holding no other: ordered locking cannot deadlock.
        # Then the rest without waiting (SKIP LOCKED never waits, so it cannot deadlock either).
        for ids, statement in ((wait, _TICK_LOCK), (skip, _TICK_LOCK_SKIP)):
            if ids:
                execute_prepared(raw, statement, (ids,))
                pipes.update((row["pipeline_id"], row) for row in dict_rows(raw))
        missing = [r.pipeline_id for r in requests if r.pipeline_id not in pipes]
        if missing:
            cur.execute("SELECT pipeline_id FROM arroyo_pipelines WHERE pipeline_id = ANY(%s)", (missing,))
            exist = {row["pipeline_id"] for row in cur.fetchall()}  # locked by another: skipped
            for i, r in enumerate(requests):
                if r.pipeline_id in missing and r.pipeline_id not in exist:
                    out[i] = UnknownPipelineError(r.pipeline_id)
        todo = [(i, r) for i, r in enumerate(requests) if r.pipeline_id in pipes]
        if not todo:
            return out
        facts, watched, observed_at = self._tick_facts(raw, [r for _, r in todo])
        starts: list[tuple[int, TickRequest, TriggerDecision]] = []
        expires: list[tuple[int, TickRequest, TriggerDecision]] = []
        decided: dict[int, tuple[TriggerFacts, TriggerDecision]] = {}
        for i, r in todo:
            pipe, f = pipes[r.pipeline_id], facts[r.pipeline_id]
            tf = TriggerFacts(
                now=f["now"],
                pipeline_state=PipelineState(pipe["state"]),
                last_epoch=int(pipe["last_epoch"]),
                in_flight_epoch=f["in_flight"],
                in_flight_timeout_at=f["in_flight_timeout_at"],
                last_triggered_at=f["last_triggered_at"],
                last_ended_at=f["last_ended_at"],
                cleanup_lease=CleanupLease(f["holder"], f["expires_at"]) if f["holder"] else None,
                stop_requested=bool(pipe["stop_requested"]),
                heartbeat_at=pipe["heartbeat_at"],
                force=r.force,
                final_epoch=r.is_final,
                pipeline_id=r.pipeline_id,
            )
            decision = decide_trigger(tf, r.policy)
            decided[i] = (tf, decision)
            if decision.action is TriggerAction.START:
                starts.append((i, r, decision))
            elif decision.action is TriggerAction.EXPIRE:
                expires.append((i, r, decision))
        started = self._start_epochs(raw, starts)
        expired = self._expire_epochs(cur, expires)
        for i, r in todo:
            f, (tf, decision) = facts[r.pipeline_id], decided[i]
            if decision.action is TriggerAction.EXPIRE and r.pipeline_id not in expired:
                out[i] = StoreError(f"epoch {decision.epoch} of pipeline {r.pipeline_id!r} was no longer in "
                                    "flight when it was to expire (changed outside the pipeline's row lock)")
                continue
            # the newest epochs' states as they are after this tick (what the failure count reads)
            states = [EpochState(s) for s in f["recent"]]
            if decision.action is TriggerAction.EXPIRE:
                states = [EpochState.EXPIRED if n == decision.epoch else s for n, s in zip(f["recent_epochs"], states,
                                                                                        strict=True)]
            if r.pipeline_id in started:
                states = [EpochState.TRIGGERED, *states][: r.policy.tolerable_failures + 2]
            ended = watched.get(r.pipeline_id, ())
            if r.pipeline_id in expired:
                ended = tuple(expired[r.pipeline_id] if e.epoch == decision.epoch else e for e in ended)
            out[i] = TickResult(decision=decision, now=tf.now,
                                pipeline_state=PipelineState(pipes[r.pipeline_id]["state"]),
                                started=started.get(r.pipeline_id), expired=expired.get(r.pipeline_id),
                                consecutive_failures=consecutive_failures(states), ended=ended,
                                last_epoch=decision.epoch if r.pipeline_id in started else tf.last_epoch,
                                observed_at=observed_at)
        return out

    @staticmethod
    def _tick_facts(cur: PgRawCursor, requests: Sequence[TickRequest]
                    ) -> tuple[dict[str, dict[str, Any]], dict[str, tuple[EpochRecord, ...]], float]:
        """Every locked pipeline's facts in one statement (a fresh statement after the locks: READ
        COMMITTED gives it a snapshot with whatever the previous lock holders committed).

        ``last_ended_at`` is the end of the newest ended epoch: with one epoch in flight at most,
        epoch n+1 starts after epoch n ended, so ends grow with epoch numbers (an index scan from
        the newest epoch, not a scan of the pipeline's whole history)."""
        pids = [r.pipeline_id for r in requests]
        t0 = time.monotonic()
        execute_prepared(cur, _TICK_FACTS, (pids, [r.policy.tolerable_failures + 2 for r in requests]))
        rows = dict_rows(cur)
        observed_at = (t0 + time.monotonic()) / 2
        facts: dict[str, dict[str, Any]] = {row["pipeline_id"]: row for row in rows}
        pairs = [(r.pipeline_id, int(e)) for r in requests for e in sorted(set(r.watch))]
        watched: dict[str, tuple[EpochRecord, ...]] = {}
        if pairs:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs JOIN unnest(%s::text[], %s::bigint[])"  # noqa: S608
                " AS w(pipeline_id, epoch) USING (pipeline_id, epoch) WHERE state <> 'triggered'"
                " ORDER BY pipeline_id, epoch",
                ([p for p, _ in pairs], [e for _, e in pairs]),
            )
            for row in dict_rows(cur):
                rec = from_row(EpochRecord, row)
                watched[rec.pipeline_id] = (*watched.get(rec.pipeline_id, ()), rec)
        return facts, watched, observed_at

    @staticmethod
    def _start_epochs(cur: PgRawCursor, starts: Sequence[tuple[int, TickRequest, TriggerDecision]]
                      ) -> dict[str, EpochRecord]:
        """Insert every decided START in one statement and move the pipelines' ``last_epoch``."""
        if not starts:
            return {}
        execute_prepared(cur, _START_EPOCHS, (
            [r.pipeline_id for _, r, _ in starts], [d.epoch for _, _, d in starts], [r.is_final for _, r, _ in starts],
            [r.triggered_by for _, r, _ in starts], [float(r.policy.effective_timeout) for _, r, _ in starts],
            [r.self_contained for _, r, _ in starts]))
        return {rec.pipeline_id: rec for rec in (from_row(EpochRecord, row) for row in dict_rows(cur))}

    @staticmethod
    def _expire_epochs(cur: PgCursor, expires: Sequence[tuple[int, TickRequest, TriggerDecision]]
                       ) -> dict[str, EpochRecord]:
        """Mark every decided EXPIRE in one guarded UPDATE (only epochs still in flight move)."""
        if not expires:
            return {}
        rows = transition(
            cur, EpochState.EXPIRED, where="e.pipeline_id = x.pipeline_id AND e.epoch = x.epoch",
            using="unnest(%(p)s::text[], %(n)s::bigint[], %(why)s::text[]) AS x(pipeline_id, epoch, reason)",
            also="ended_at = clock_timestamp(), failure_reason = x.reason", returning=epoch_columns("e"),
            params={"p": [r.pipeline_id for _, r, _ in expires], "n": [d.epoch for _, _, d in expires],
                    "why": [f"not acknowledged by every stage within {r.policy.effective_timeout:g}s"
                            for _, r, _ in expires]},
        )
        return {rec.pipeline_id: rec for rec in (from_row(EpochRecord, row) for row in rows)}

    # ------------------------------------------------------------------ epochs

    def get_epoch(self, pipeline_id: str, epoch: int) -> EpochRecord:
        def tx(cur: PgCursor) -> EpochRecord:
            cur.execute(f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s",  # noqa: S608
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch)
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    def list_epochs(self, pipeline_id: str, *, limit: int = 100, before: int | None = None,
                    states: Iterable[EpochState] | None = None) -> list[EpochRecord]:
        """Newest first, ``limit`` at most, epochs numbered below ``before`` when given."""
        state_list = [EpochState(s).value for s in states] if states is not None else None

        def tx(cur: PgCursor) -> list[EpochRecord]:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %(p)s"  # noqa: S608
                " AND (%(before)s::bigint IS NULL OR epoch < %(before)s)"
                " AND (%(states)s::text[] IS NULL OR state = ANY(%(states)s))"
                " ORDER BY epoch DESC LIMIT %(limit)s",
                {"p": pipeline_id, "before": before, "states": state_list, "limit": limit},
            )
            rows = cur.fetchall()
            if not rows:
                read_pipeline(cur, pipeline_id)
            return [from_row(EpochRecord, r) for r in rows]

        return self._db.tx(tx)

    def in_flight_epoch(self, pipeline_id: str) -> EpochRecord | None:
        rows = self.list_epochs(pipeline_id, limit=1, states=[EpochState.TRIGGERED])
        return rows[0] if rows else None

    def latest_completed_epoch(self, pipeline_id: str) -> EpochRecord | None:
        rows = self.list_epochs(pipeline_id, limit=1, states=[EpochState.COMPLETED])
        return rows[0] if rows else None

    def mark_unrestorable(self, pipeline_id: str, epoch: int, reason: str, *,
                          token: FencingToken | None = None) -> None:
        """Record that a restore proved ``epoch`` can never be restored, and why (the first reason stays).
        Its state is not changed: it stays what it was for retention; ``'latest'`` and supervision read it."""

        def tx(cur: PgCursor) -> None:
            check_token(cur, token, f"marking epoch {epoch} unrestorable")
            cur.execute("UPDATE arroyo_epochs SET unrestorable = COALESCE(unrestorable, %s)"
                        " WHERE pipeline_id = %s AND epoch = %s", (reason[:4000], pipeline_id, epoch))
            if cur.rowcount == 0:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch, "to mark unrestorable")

        self._db.tx(tx)

    @staticmethod
    def check_pin_label(label: object) -> str:
        """The pin label as stored (stripped); :class:`ConfigurationError` unless it is 1 to 200 characters."""
        text = label.strip() if isinstance(label, str) else ""
        if not text or len(text) > PIN_LABEL_MAX:
            raise ConfigurationError(
                f"pin label must be 1 to {PIN_LABEL_MAX} characters of text, got {label!r}: say why the epoch "
                "is kept, e.g. --label 'before the 2.0 upgrade'"
            )
        return text

    def pin_epoch(self, pipeline_id: str, epoch: int, label: str, *, replace: bool = False) -> EpochRecord:
        """Pin a completed epoch with ``label``: retention keeps it, its snapshot objects and the channel
        ranges a restore of it reads, until :meth:`unpin_epoch`. Pinning a pinned epoch with its own label
        again changes nothing; with another label it is refused unless ``replace`` (``pinned_at`` stays the
        first pin's), since the label is why someone kept it.

        Raises :class:`ConfigurationError` for an empty or over-long label, an epoch that is not
        completed (nothing restorable to keep) or pinned with another label (naming it) without
        ``replace``, :class:`UnknownEpochError` for an unknown one.
        """
        text = self.check_pin_label(label)

        def tx(cur: PgCursor) -> EpochRecord:
            lock_pipeline(cur, pipeline_id)  # retention's begin_prune holds the same lock
            # the row lock keeps the state we check until the pin is written
            cur.execute("SELECT state, pin_label FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (pipeline_id, epoch))
            found = cur.fetchone()
            if found is None:
                raise UnknownEpochError(pipeline_id, epoch, "to pin")
            if found["pin_label"] is not None and found["pin_label"] != text and not replace:
                raise ConfigurationError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is already pinned with label {found['pin_label']!r}; "
                    "pass --replace to replace that label (replace=True), or keep it"
                )
            if found["state"] != EpochState.COMPLETED.value:
                raise ConfigurationError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is {found['state']}, not completed: only a completed "
                    "epoch can be restored, so only one can be pinned; pick a completed epoch (airflow-arroyo "
                    f"epochs {pipeline_id})" + (" or wait for this one to end" if found["state"] == "triggered" else "")
                )
            cur.execute(
                f"UPDATE arroyo_epochs SET pin_label = %s, pinned_at = COALESCE(pinned_at, clock_timestamp())"  # noqa: S608
                f" WHERE pipeline_id = %s AND epoch = %s RETURNING {_EPOCH_COLS}",
                (text, pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:  # cannot happen under the row lock; say what it would mean
                raise UnknownEpochError(pipeline_id, epoch, "to pin")
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    def pin_final_epoch(self, pipeline_id: str, run_id: str | None, label: str) -> EpochRecord:
        """Pin the final epoch a graceful stop of run ``run_id`` took (the second half of "stop and pin").

        Raises :class:`ConfigurationError` when that run completed no final epoch (an immediate stop, a final
        epoch that failed or timed out), naming the latest completed epoch, which can be pinned instead."""

        def tx(cur: PgCursor) -> int | None:
            read_pipeline(cur, pipeline_id)
            cur.execute("SELECT epoch FROM arroyo_epochs WHERE pipeline_id = %s AND run_id IS NOT DISTINCT FROM %s"
                        " AND is_final AND state = %s ORDER BY epoch DESC LIMIT 1",
                        (pipeline_id, run_id, EpochState.COMPLETED.value))
            row = cur.fetchone()
            return int(row["epoch"]) if row is not None else None

        final = self._db.tx(tx)
        if final is None:
            latest = self.latest_completed_epoch(pipeline_id)
            instead = (f"pin the latest completed epoch instead: airflow-arroyo pin {pipeline_id} {latest.epoch} "
                       "--label ..." if latest is not None else "no epoch of it is completed")
            raise ConfigurationError(
                f"run {run_id} of pipeline {pipeline_id!r} completed no final epoch (an immediate stop, or its final "
                f"epoch failed or timed out), so nothing was pinned; {instead}"
            )
        return self.pin_epoch(pipeline_id, final, label)

    def unpin_epoch(self, pipeline_id: str, epoch: int, *, force: bool = False) -> EpochRecord:
        """Unpin ``epoch`` (idempotent: an epoch that is not pinned is returned as it is); retention may
        prune it again from its next run.

        Refused (:class:`ConfigurationError`, naming them) while a fork of this epoch has not completed an
        epoch of its own (:meth:`waiting_forks`): its first restore reads this epoch's objects and channel
        ranges. ``force`` unpins anyway; those forks can then no longer start once retention prunes it."""

        def tx(cur: PgCursor) -> EpochRecord:
            lock_pipeline(cur, pipeline_id)
            waiting = self._waiting_forks(cur, pipeline_id, epoch)
            if waiting and not force:
                raise ConfigurationError(
                    f"epoch {epoch} of pipeline {pipeline_id!r} is the fork point of {', '.join(waiting)}, which "
                    "has not completed an epoch of its own yet: its first run restores from this epoch. Run the fork "
                    "until it completes an epoch, or unpin with --force if the fork is abandoned"
                )
            cur.execute(
                f"UPDATE arroyo_epochs SET pin_label = NULL, pinned_at = NULL"  # noqa: S608
                f" WHERE pipeline_id = %s AND epoch = %s RETURNING {_EPOCH_COLS}",
                (pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch, "to unpin")
            return from_row(EpochRecord, row)

        return self._db.tx(tx)

    @staticmethod
    def _waiting_forks(cur: PgCursor, pipeline_id: str, epoch: int | None = None) -> list[str]:
        """Forks of ``pipeline_id`` (of its ``epoch``, or of any) that have not completed an epoch of their own:
        they still need their fork point. A fork's own epoch that completed once (outcome ``completed`` or
        ``superseded``) holds its own copy of every object, so the fork no longer reads the source's."""
        cur.execute(
            "SELECT f.pipeline_id FROM arroyo_pipelines f WHERE f.forked_from_pipeline = %s"
            " AND (%s::bigint IS NULL OR f.forked_from_epoch = %s::bigint)"
            " AND NOT EXISTS (SELECT 1 FROM arroyo_epochs e WHERE e.pipeline_id = f.pipeline_id"
            "   AND e.outcome IN ('completed', 'superseded'))"
            " ORDER BY f.pipeline_id",
            (pipeline_id, epoch, epoch),
        )
        return [r["pipeline_id"] for r in cur.fetchall()]

    def waiting_forks(self, pipeline_id: str, epoch: int | None = None) -> list[str]:
        """The forks of ``pipeline_id`` (of its ``epoch`` when given) that still need their fork point."""
        return self._db.tx(lambda cur: self._waiting_forks(cur, pipeline_id, epoch))

    # ------------------------------------------------------------------ supervision (airflow_arroyo.supervision)

    def supervise(self, pipeline_id: str, lineage: str, strategy: Mapping[str, Any]) -> PipelineRecord:
        """Put the pipeline's current run under supervision as lineage ``lineage`` (its first run id) with
        ``strategy`` (a strategy's dict, shown by the UI and the CLI). A supervision of that lineage still
        watching or restarting goes on (a retried task reattaching: its failures keep counting); otherwise
        a new one begins (``supervised_since``: its failures count from now). Raises
        :class:`ConcurrencyConflict` when the current run is not of that lineage (another run took over)."""

        def tx(cur: PgCursor) -> PipelineRecord:
            current = lock_pipeline(cur, pipeline_id)
            if not current["run_id"] or not is_run_of(current["run_id"], lineage):
                raise ConcurrencyConflict(
                    f"pipeline {pipeline_id!r} runs {current['run_id']!r}, not run {lineage!r} or a restart of it: "
                    "another submit took it over; this supervisor lets go")
            goes_on = current["supervised_run"] == lineage and current["supervision"] in _SUPERVISING
            cur.execute(
                "UPDATE arroyo_pipelines SET supervised_run = %s, restart_strategy = %s::jsonb,"
                " supervision = CASE WHEN %s THEN supervision ELSE 'watching' END,"
                " supervised_since = CASE WHEN %s THEN supervised_since ELSE clock_timestamp() END,"
                " updated_at = now() WHERE pipeline_id = %s RETURNING *",
                (lineage, json.dumps(dict(strategy)), goes_on, goes_on, pipeline_id),
            )
            return from_row(PipelineRecord, one(cur))

        return self._db.tx(tx)

    @staticmethod
    def _supervised(pipeline_id: str, lineage: str, current: Mapping[str, Any]) -> datetime:
        """The current supervision of ``lineage`` (its ``supervised_since``), or ConcurrencyConflict."""
        if (current["supervised_run"] != lineage or current["supervised_since"] is None
                or not current["run_id"] or not is_run_of(current["run_id"], lineage)):
            raise ConcurrencyConflict(
                f"pipeline {pipeline_id!r} is run {current['run_id']!r} (supervised lineage "
                f"{current['supervised_run']!r}), not lineage {lineage!r}: another submit took it over")
        since: datetime = current["supervised_since"]
        return since

    def record_failure(self, pipeline_id: str, lineage: str, failed_run_id: str, cause: str,
                       decide: Callable[[list[PastFailure], datetime, bool], RestartDecision]) -> RestartRecord:
        """Record that run ``failed_run_id`` of a supervised lineage failed with ``cause``, and what
        ``decide`` (given this supervision's failures so far, this one last, the database's clock, and
        whether a stop was requested) made of it: the restart's delay, or giving up. Under the pipeline's
        row lock, so two triggerers noticing the same failure record it once: the second gets the first's
        row (also after a triggerer restart). Raises :class:`ConcurrencyConflict` when the pipeline is no
        longer this lineage's."""

        def tx(cur: PgCursor) -> RestartRecord:
            current = lock_pipeline(cur, pipeline_id)
            since = self._supervised(pipeline_id, lineage, current)
            cur.execute("SELECT * FROM arroyo_restarts WHERE pipeline_id = %s AND supervised_since = %s"
                        " AND failed_run_id = %s", (pipeline_id, since, failed_run_id))
            seen = cur.fetchone()
            if seen is not None:
                record = from_row(RestartRecord, seen)
            else:
                cur.execute("SELECT failed_at, restarted_at FROM arroyo_restarts WHERE pipeline_id = %s"
                            " AND lineage = %s AND supervised_since = %s ORDER BY attempt",
                            (pipeline_id, lineage, since))
                failures = [PastFailure(r["failed_at"], r["restarted_at"]) for r in cur.fetchall()]
                cur.execute("SELECT clock_timestamp() AS now")
                now = one(cur)["now"]
                failures.append(PastFailure(now))
                cur.execute("SELECT epoch, unrestorable FROM arroyo_epochs WHERE pipeline_id = %s"
                            " AND state = 'completed' ORDER BY epoch DESC LIMIT 1", (pipeline_id,))
                latest = cur.fetchone()
                if latest is not None and latest["unrestorable"] and not current["stop_requested"]:
                    decision = unrestorable_latest(latest["epoch"], latest["unrestorable"])
                else:
                    decision = decide(failures, now, bool(current["stop_requested"]))
                cur.execute(
                    "INSERT INTO arroyo_restarts (pipeline_id, lineage, supervised_since, attempt, failed_run_id,"
                    " cause, failed_at, delay_s, gave_up, decision) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
                    " RETURNING *",
                    (pipeline_id, lineage, since, len(failures), failed_run_id, cause[:4000], now,
                     decision.delay if decision.restart else 0.0, not decision.restart, decision.reason),
                )
                record = from_row(RestartRecord, one(cur))
            if record.new_run_id is None:  # decided, not restarted yet: the pipeline says what comes next
                state = SupervisionState.GAVE_UP if record.gave_up else SupervisionState.RESTARTING
                cur.execute("UPDATE arroyo_pipelines SET supervision = %s, updated_at = now()"
                            " WHERE pipeline_id = %s AND supervision IS DISTINCT FROM %s",
                            (state.value, pipeline_id, state.value))
            return record

        return self._db.tx(tx)

    def claim_restart(self, pipeline_id: str, lineage: str, attempt: int) -> str | None:
        """Whether restart ``attempt`` of the lineage may be submitted now: None if so, else why not (a stop
        was requested since the failure, the supervision ended or moved on, another run took over)."""

        def tx(cur: PgCursor) -> str | None:
            current = lock_pipeline(cur, pipeline_id)
            try:
                since = self._supervised(pipeline_id, lineage, current)
            except ConcurrencyConflict as exc:
                return str(exc)
            if current["stop_requested"]:
                return f"a stop ({current['stop_requested']}) was requested while the restart was due"
            if current["supervision"] != SupervisionState.RESTARTING.value:
                return f"the supervision is {current['supervision']}, not restarting"
            cur.execute("SELECT new_run_id, gave_up FROM arroyo_restarts WHERE pipeline_id = %s AND lineage = %s"
                        " AND supervised_since = %s AND attempt = %s", (pipeline_id, lineage, since, attempt))
            row = cur.fetchone()
            if row is None or row["gave_up"] or row["new_run_id"] is not None:
                return f"failure {attempt} is not one whose restart is due"
            return None

        return self._db.tx(tx)

    def record_restart(self, pipeline_id: str, lineage: str, attempt: int, new_run_id: str,
                       restored_epoch: int | None) -> RestartRecord:
        """Record that restart ``attempt`` of the lineage's current supervision was submitted as run
        ``new_run_id``, restoring ``restored_epoch`` (None: no completed epoch, a start over); the
        supervisor watches again."""

        def tx(cur: PgCursor) -> RestartRecord:
            current = lock_pipeline(cur, pipeline_id)
            cur.execute(
                "UPDATE arroyo_restarts SET new_run_id = %s, restored_epoch = %s,"
                " restarted_at = COALESCE(restarted_at, clock_timestamp())"
                " WHERE pipeline_id = %s AND lineage = %s AND supervised_since = %s AND attempt = %s RETURNING *",
                (new_run_id, restored_epoch, pipeline_id, lineage, current["supervised_since"], attempt),
            )
            row = cur.fetchone()
            if row is None:
                raise ConfigurationError(f"pipeline {pipeline_id!r} lineage {lineage!r} has no failure {attempt} "
                                         "recorded to restart after")
            cur.execute("UPDATE arroyo_pipelines SET supervision = 'watching', updated_at = now()"
                        " WHERE pipeline_id = %s AND supervised_run = %s AND supervision = 'restarting'",
                        (pipeline_id, lineage))
            return from_row(RestartRecord, row)

        return self._db.tx(tx)

    def end_supervision(self, pipeline_id: str, lineage: str,
                        state: SupervisionState = SupervisionState.ENDED) -> None:
        """The supervisor of ``lineage`` lets go (the pipeline stopped, a stop cancelled a restart, it gave up
        or failed itself): a failed run of it is no longer coming back. A no-op when another lineage is
        supervised meanwhile."""
        self._db.tx(lambda cur: cur.execute(
            "UPDATE arroyo_pipelines SET supervision = %s, updated_at = now()"
            " WHERE pipeline_id = %s AND supervised_run = %s", (state.value, pipeline_id, lineage)))

    def restarts(self, pipeline_id: str, lineage: str | None = None, limit: int = 200) -> list[RestartRecord]:
        """The failures and restarts a supervisor recorded for the pipeline, newest first (of one lineage,
        or of all)."""

        def tx(cur: PgCursor) -> list[RestartRecord]:
            cur.execute(
                "SELECT * FROM arroyo_restarts WHERE pipeline_id = %s AND (%s::text IS NULL OR lineage = %s)"
                " ORDER BY failed_at DESC, attempt DESC LIMIT %s",
                (pipeline_id, lineage, lineage, int(limit)),
            )
            return [from_row(RestartRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def restart_counts(self) -> dict[str, int]:
        """How many times each supervised pipeline's current lineage was restarted (resubmitted after a
        failure; a failure the strategy gave up on, or whose restart is still due, does not count). Only
        pipelines with a supervision state are in it: a pipeline never supervised, or whose current run is
        not of the lineage it recorded, has no count."""

        def tx(cur: PgCursor) -> dict[str, int]:
            cur.execute(
                "SELECT p.pipeline_id, count(r.restarted_at) AS restarts FROM arroyo_pipelines p"
                " LEFT JOIN arroyo_restarts r ON r.pipeline_id = p.pipeline_id AND r.lineage = p.supervised_run"
                " AND r.supervised_since = p.supervised_since"
                " WHERE p.supervision IS NOT NULL GROUP BY p.pipeline_id"
            )
            return {r["pipeline_id"]: int(r["restarts"]) for r in cur.fetchall()}

        return self._db.tx(tx)

    def forks_of(self, pipeline_id: str) -> list[PipelineRecord]:
        """Every pipeline forked from ``pipeline_id``, by fork point then id."""

        def tx(cur: PgCursor) -> list[PipelineRecord]:
            cur.execute("SELECT * FROM arroyo_pipelines WHERE forked_from_pipeline = %s"
                        " ORDER BY forked_from_epoch, pipeline_id", (pipeline_id,))
            return [from_row(PipelineRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def fork_pipeline(self, source: str, epoch: int, new_id: str) -> PipelineRecord:
        """Fork pipeline ``new_id`` from completed ``epoch`` of ``source``, in one transaction under the
        source's row lock (retention's ``begin_prune`` takes the same lock, so a fork never races a prune).

        The fork's row is created ``stopped``, with no run, the source's stages, storage URI and config,
        ``last_epoch = epoch`` (its own epochs are numbered after the fork point) and the fork point
        recorded; nothing is copied: its first run restores the source's epoch, reading the source's snapshot
        objects where they are. The fork point is pinned in the source (label ``fork:<new_id>``; an epoch
        pinned already keeps its label) and cannot be unpinned while the fork still needs it
        (:meth:`unpin_epoch`).

        Idempotent: forking the same epoch to the same id again returns the fork. Raises
        :class:`ConfigurationError` for a bad or taken id or an epoch that is not completed,
        :class:`UnknownPipelineError` / :class:`UnknownEpochError` for unknown ones.
        """
        validate_pipeline_id(new_id)
        if new_id == source:
            raise ConfigurationError(f"a fork needs a new pipeline id, got the source's own ({source!r})")
        label = f"fork:{new_id}"[:PIN_LABEL_MAX]

        def tx(cur: PgCursor) -> PipelineRecord:
            src = lock_pipeline(cur, source)
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (source, epoch))
            found = cur.fetchone()
            if found is None:
                raise UnknownEpochError(source, epoch, "to fork from")
            cur.execute("SELECT * FROM arroyo_pipelines WHERE pipeline_id = %s", (new_id,))
            existing = cur.fetchone()
            if existing is not None:
                if existing["forked_from_pipeline"] == source and existing["forked_from_epoch"] == epoch:
                    return from_row(PipelineRecord, existing)  # a retried fork
                raise ConfigurationError(
                    f"pipeline {new_id!r} already exists; fork to a new pipeline id (airflow-arroyo pipelines lists "
                    "the taken ones)"
                )
            if found["state"] != EpochState.COMPLETED.value:
                raise ConfigurationError(
                    f"epoch {epoch} of pipeline {source!r} is {found['state']}, not completed: a fork starts by "
                    f"restoring its fork point, so fork from a completed epoch (airflow-arroyo epochs {source})"
                )
            cur.execute(
                "INSERT INTO arroyo_pipelines (pipeline_id, state, stages, storage_uri, checkpoint_interval_s,"
                " last_epoch, config, forked_from_pipeline, forked_from_epoch, forked_at)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s, clock_timestamp()) RETURNING *",
                (new_id, PipelineState.STOPPED.value, src["stages"], src["storage_uri"], src["checkpoint_interval_s"],
                 epoch, json.dumps(src["config"] or {}), source, epoch),
            )
            fork = from_row(PipelineRecord, one(cur))
            cur.execute(
                "UPDATE arroyo_epochs SET pin_label = %s, pinned_at = clock_timestamp()"
                " WHERE pipeline_id = %s AND epoch = %s AND pin_label IS NULL",
                (label, source, epoch),
            )
            return fork

        return self._db.tx(tx)

    def oldest_completed_epoch(self, pipeline_id: str) -> EpochRecord | None:
        """The oldest epoch a restore can still pick (completed, not pruned or superseded)."""

        def tx(cur: PgCursor) -> EpochRecord | None:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND state = %s"  # noqa: S608
                " ORDER BY epoch LIMIT 1",
                (pipeline_id, EpochState.COMPLETED.value),
            )
            row = cur.fetchone()
            return from_row(EpochRecord, row) if row else None

        return self._db.tx(tx)

    def ack_epoch(
        self,
        pipeline_id: str,
        epoch: int,
        stage: str,
        *,
        cursors: Mapping[str, int] | None = None,
        alignment_ms: float | None = None,
        sync_ms: float | None = None,
        async_ms: float | None = None,
        bytes_new: int | None = None,
        bytes_total: int | None = None,
        snapshot_uri: str | None = None,
        details: Mapping[str, Any] | None = None,
        token: FencingToken | None = None,
    ) -> EpochState:
        """Record a stage's acknowledgement (idempotent per stage); complete the epoch when it is the
        last one expected. Returns the epoch's state afterwards. An ack for an epoch that already
        expired or failed is kept for the record and changes nothing."""

        def tx(cur: PgCursor) -> EpochState:
            # The pipeline's row lock first, like every other writer of epoch states: an ack that
            # completes the epoch must not race the trigger expiring it (the trigger's guarded UPDATE
            # would find no row), and the history must stay in commit order per pipeline.
            lock_pipeline(cur, pipeline_id)
            check_token(cur, token, f"the acknowledgement of epoch {epoch} by stage {stage!r}")
            cur.execute(
                "SELECT state, stages FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                (pipeline_id, epoch),
            )
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch, "to acknowledge")
            if stage not in row["stages"]:
                raise ConfigurationError(
                    f"stage {stage!r} is not one of the stages of epoch {epoch} of {pipeline_id!r} "
                    f"({', '.join(row['stages'])})"
                )
            cur.execute(
                "INSERT INTO arroyo_acks (pipeline_id, epoch, stage, cursors, alignment_ms, sync_ms, async_ms,"
                " bytes_new, bytes_total, snapshot_uri, details)"
                " VALUES (%s, %s, %s, %s::jsonb, %s, %s, %s, %s, %s, %s, %s::jsonb)"
                " ON CONFLICT (pipeline_id, epoch, stage) DO NOTHING",
                (pipeline_id, epoch, stage, json.dumps(dict(cursors or {})), alignment_ms, sync_ms, async_ms,
                 bytes_new, bytes_total, snapshot_uri, json.dumps(dict(details or {}))),
            )
            state = EpochState(row["state"])
            if EpochState.COMPLETED not in EPOCH_TRANSITIONS[state]:
                return state
            cur.execute(
                "SELECT count(*) AS n, COALESCE(sum(bytes_new), 0) AS bn, COALESCE(sum(bytes_total), 0) AS bt"
                " FROM arroyo_acks WHERE pipeline_id = %s AND epoch = %s AND stage = ANY(%s)",
                (pipeline_id, epoch, row["stages"]),
            )
            agg = one(cur)
            if int(agg["n"]) < len(set(row["stages"])):
                return state
            transition(cur, EpochState.COMPLETED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                       also="ended_at = clock_timestamp(), bytes_new = %(bn)s, bytes_total = %(bt)s",
                       params={"p": pipeline_id, "n": epoch, "bn": agg["bn"], "bt": agg["bt"]})
            return EpochState.COMPLETED

        return self._db.tx(tx)

    def fail_epoch(self, pipeline_id: str, epoch: int, reason: str, *, token: FencingToken | None = None) -> EpochState:
        """Mark an in-flight epoch failed (e.g. a stage could not snapshot). No-op if it already ended."""

        def tx(cur: PgCursor) -> EpochState:
            lock_pipeline(cur, pipeline_id)  # serialised with the trigger and cleanup, see ack_epoch
            check_token(cur, token, f"failing epoch {epoch}")
            if transition(cur, EpochState.FAILED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                          also="ended_at = clock_timestamp(), failure_reason = %(reason)s",
                          params={"p": pipeline_id, "n": epoch, "reason": reason}):
                return EpochState.FAILED
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s",
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                raise UnknownEpochError(pipeline_id, epoch)
            return EpochState(row["state"])

        return self._db.tx(tx)

    def acks(self, pipeline_id: str, epoch: int) -> list[AckRecord]:
        def tx(cur: PgCursor) -> list[AckRecord]:
            cur.execute("SELECT * FROM arroyo_acks WHERE pipeline_id = %s AND epoch = %s ORDER BY acked_at",
                        (pipeline_id, epoch))
            return [from_row(AckRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    # ------------------------------------------------------------------ snapshot objects

    def known_objects(self, pipeline_id: str, keys: Iterable[str]) -> set[str]:
        """Which of ``keys`` are already stored for the pipeline (incremental snapshots skip them). An object
        a scrub found missing or corrupt is not: the next snapshot that has the file copies it again."""
        key_list = list(keys)

        def tx(cur: PgCursor) -> set[str]:
            cur.execute("SELECT object_key FROM arroyo_objects WHERE pipeline_id = %s AND object_key = ANY(%s)"
                        " AND verify_state IS DISTINCT FROM 'missing' AND verify_state IS DISTINCT FROM 'corrupt'",
                        (pipeline_id, key_list))
            return {r["object_key"] for r in cur.fetchall()}

        return self._db.tx(tx) if key_list else set()

    def record_snapshot(self, pipeline_id: str, epoch: int, stage: str, entries: Sequence[SnapshotEntry], *,
                        token: FencingToken | None = None) -> None:
        """Record the files of a stage's snapshot for an epoch (objects are inserted once).

        Refused with :class:`ConcurrencyConflict` once the epoch is ``pruning`` or ``pruned`` (a late
        acknowledgement after expiry and cleanup): recorded then, its objects would never be deleted.
        The caller should delete the objects it wrote new for this snapshot.
        """

        def tx(cur: PgCursor) -> None:
            check_token(cur, token, f"the snapshot of stage {stage!r} for epoch {epoch}")
            cur.execute("SELECT state FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s FOR UPDATE",
                        (pipeline_id, epoch))
            row = cur.fetchone()
            if row is None:
                read_pipeline(cur, pipeline_id)
                raise UnknownEpochError(pipeline_id, epoch, "to record a snapshot for")
            if row["state"] in (EpochState.PRUNING.value, EpochState.PRUNED.value):
                raise ConcurrencyConflict(
                    f"epoch {epoch} of {pipeline_id!r} is {row['state']}: the snapshot of stage {stage!r} came "
                    "too late to be recorded"
                )
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO arroyo_objects (pipeline_id, object_key, bytes, first_epoch) VALUES %s"
                " ON CONFLICT (pipeline_id, object_key) DO UPDATE SET verified_at = NULL, verify_state = NULL,"
                "   verify_detail = NULL WHERE arroyo_objects.verify_state IN ('missing', 'corrupt')",
                sorted({(pipeline_id, e.object_key, e.bytes, epoch) for e in entries}),
            )
            psycopg2.extras.execute_values(
                cur,
                "INSERT INTO arroyo_epoch_objects (pipeline_id, epoch, stage, rel_path, object_key) VALUES %s"
                " ON CONFLICT DO NOTHING",
                [(pipeline_id, epoch, stage, e.rel_path, e.object_key) for e in entries],
            )

        if entries:
            self._db.tx(tx)

    def snapshot_entries(self, pipeline_id: str, epoch: int, stage: str) -> list[SnapshotEntry]:
        def tx(cur: PgCursor) -> list[SnapshotEntry]:
            cur.execute(
                "SELECT eo.rel_path, eo.object_key, o.bytes FROM arroyo_epoch_objects eo"
                " JOIN arroyo_objects o USING (pipeline_id, object_key)"
                " WHERE eo.pipeline_id = %s AND eo.epoch = %s AND eo.stage = %s ORDER BY eo.rel_path",
                (pipeline_id, epoch, stage),
            )
            return [SnapshotEntry(r["rel_path"], r["object_key"], int(r["bytes"])) for r in cur.fetchall()]

        return self._db.tx(tx)

    # ------------------------------------------------------------------ scrubbing (migration 0005)

    def objects_to_verify(self, pipeline_id: str, *, epoch: int | None = None) -> list[ObjectRecord]:
        """The objects the retained epochs (or only ``epoch``) reference, least recently verified first
        (never verified first, then oldest check), each with the retained epochs that reference it."""

        def tx(cur: PgCursor) -> list[ObjectRecord]:
            read_pipeline(cur, pipeline_id)
            if epoch is not None:
                cur.execute("SELECT 1 FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = %s", (pipeline_id, epoch))
                if cur.fetchone() is None:
                    raise ConfigurationError(f"pipeline {pipeline_id!r} has no epoch {epoch}")
            cur.execute(
                "SELECT o.object_key, o.bytes, o.verified_at, o.verify_state, o.verify_detail,"
                " array_agg(DISTINCT eo.epoch ORDER BY eo.epoch) AS epochs"
                " FROM arroyo_objects o JOIN arroyo_epoch_objects eo USING (pipeline_id, object_key)"
                " JOIN arroyo_epochs e USING (pipeline_id, epoch)"
                " WHERE o.pipeline_id = %s AND e.state NOT IN ('pruning', 'pruned')"
                " AND (%s::bigint IS NULL OR o.object_key IN (SELECT object_key FROM arroyo_epoch_objects"
                "   WHERE pipeline_id = %s AND epoch = %s))"
                " GROUP BY o.object_key, o.bytes, o.verified_at, o.verify_state, o.verify_detail"
                " ORDER BY o.verified_at NULLS FIRST, o.object_key",
                (pipeline_id, epoch, pipeline_id, epoch),
            )
            return [ObjectRecord(r["object_key"], int(r["bytes"]), r["verified_at"], r["verify_state"],
                                 r["verify_detail"], tuple(int(e) for e in r["epochs"])) for r in cur.fetchall()]

        return self._db.tx(tx)

    def record_verification(self, pipeline_id: str, results: Sequence[tuple[str, str, str | None]]) -> None:
        """Record scrub results ``(object_key, 'ok' | 'missing' | 'corrupt', detail)`` at database time."""

        def tx(cur: PgCursor) -> None:
            psycopg2.extras.execute_values(
                cur,
                "UPDATE arroyo_objects o SET verified_at = clock_timestamp(), verify_state = r.state,"
                " verify_detail = r.detail FROM (VALUES %s) AS r(pipeline_id, object_key, state, detail)"
                " WHERE o.pipeline_id = r.pipeline_id AND o.object_key = r.object_key",
                [(pipeline_id, k, st, d) for k, st, d in results],
            )

        if results:
            self._db.tx(tx)

    def damaged_objects(self, pipeline_id: str) -> list[ObjectRecord]:
        """Objects the last scrub found missing or corrupt that retained epochs still reference."""
        return [o for o in self.objects_to_verify(pipeline_id) if o.verify_state not in (None, "ok")]

    # ------------------------------------------------------------------ cleanup lock and pruning

    def acquire_cleanup_lock(self, pipeline_id: str, holder: str, *, ttl: float = 60.0,
                             policy: Mapping[str, Any] | None = None) -> CleanupRunRecord:
        """Take the pipeline's cleanup lease for ``ttl`` seconds and open a cleanup run.

        Raises :class:`CleanupLockHeld` if another run holds an unexpired lease. An expired lease
        (its holder crashed) is taken over and that run is marked ``lock_lost``.
        """
        positive_seconds(ttl, "cleanup lock ttl")

        def tx(cur: PgCursor) -> CleanupRunRecord:
            lock_pipeline(cur, pipeline_id)
            cur.execute(
                "SELECT cleanup_run, holder, expires_at, expires_at > clock_timestamp() AS live"
                " FROM arroyo_cleanup_locks WHERE pipeline_id = %s",
                (pipeline_id,),
            )
            current = cur.fetchone()
            if current is not None and current["live"]:
                raise CleanupLockHeld(pipeline_id, current["holder"], current["expires_at"])
            cur.execute(
                "INSERT INTO arroyo_cleanup_runs (pipeline_id, holder, policy) VALUES (%s, %s, %s::jsonb)"
                " RETURNING *",
                (pipeline_id, holder, json.dumps(dict(policy or {}), default=str)),
            )
            run = from_row(CleanupRunRecord, one(cur))
            lease = timedelta(seconds=ttl)
            if current is None:
                cur.execute(
                    "INSERT INTO arroyo_cleanup_locks (pipeline_id, cleanup_run, holder, acquired_at, expires_at)"
                    " VALUES (%s, %s, %s, clock_timestamp(), clock_timestamp() + %s)",
                    (pipeline_id, run.id, holder, lease),
                )
            else:
                cur.execute(
                    "UPDATE arroyo_cleanup_runs SET state = 'lock_lost', ended_at = clock_timestamp(),"
                    " error = COALESCE(error, 'lease expired; taken over by run ' || %s)"
                    " WHERE id = %s AND state = 'running'",
                    (run.id, current["cleanup_run"]),
                )
                cur.execute(
                    "UPDATE arroyo_cleanup_locks SET cleanup_run = %s, holder = %s, acquired_at = clock_timestamp(),"
                    " expires_at = clock_timestamp() + %s WHERE pipeline_id = %s",
                    (run.id, holder, lease, pipeline_id),
                )
            return run

        return self._db.tx(tx)

    @staticmethod
    def _check_lease(cur: PgCursor, pipeline_id: str, cleanup_run: int) -> None:
        cur.execute(
            "SELECT 1 FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND cleanup_run = %s"
            " AND expires_at > clock_timestamp()",
            (pipeline_id, cleanup_run),
        )
        if cur.fetchone() is None:
            raise LockLostError(
                f"cleanup run {cleanup_run} of pipeline {pipeline_id!r} no longer holds the cleanup lock "
                "(its lease expired or was taken over); it must stop deleting"
            )

    def renew_cleanup_lock(self, pipeline_id: str, cleanup_run: int, *, ttl: float = 60.0) -> datetime:
        """Extend our lease; raises :class:`LockLostError` if it already expired or was taken over."""
        positive_seconds(ttl, "cleanup lock ttl")

        def tx(cur: PgCursor) -> datetime:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute(
                "UPDATE arroyo_cleanup_locks SET expires_at = clock_timestamp() + %s"
                " WHERE pipeline_id = %s AND cleanup_run = %s RETURNING expires_at",
                (timedelta(seconds=ttl), pipeline_id, cleanup_run),
            )
            expires: datetime = one(cur)["expires_at"]
            return expires

        return self._db.tx(tx)

    def release_cleanup_lock(self, pipeline_id: str, cleanup_run: int, *, state: str = "succeeded",
                             error: str | None = None) -> CleanupRunRecord:
        """Close the cleanup run and drop the lease if we still hold it."""
        if state not in ("succeeded", "failed", "lock_lost"):
            raise ConfigurationError(f"cleanup run end state must be succeeded, failed or lock_lost, got {state!r}")

        def tx(cur: PgCursor) -> CleanupRunRecord:
            lock_pipeline(cur, pipeline_id)
            cur.execute("DELETE FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND cleanup_run = %s",
                        (pipeline_id, cleanup_run))
            cur.execute(
                "UPDATE arroyo_cleanup_runs SET state = CASE WHEN state = 'running' THEN %s ELSE state END,"
                " ended_at = COALESCE(ended_at, clock_timestamp()), error = COALESCE(%s, error)"
                " WHERE id = %s AND pipeline_id = %s RETURNING *",
                (state, error, cleanup_run, pipeline_id),
            )
            return from_row(CleanupRunRecord, one(cur))

        return self._db.tx(tx)

    def cleanup_lock(self, pipeline_id: str) -> CleanupLockRecord | None:
        """The unexpired cleanup lease of the pipeline, if any."""

        def tx(cur: PgCursor) -> CleanupLockRecord | None:
            cur.execute(
                "SELECT * FROM arroyo_cleanup_locks WHERE pipeline_id = %s AND expires_at > clock_timestamp()",
                (pipeline_id,),
            )
            row = cur.fetchone()
            return from_row(CleanupLockRecord, row) if row else None

        return self._db.tx(tx)

    def list_cleanup_runs(self, pipeline_id: str, *, limit: int = 50) -> list[CleanupRunRecord]:
        def tx(cur: PgCursor) -> list[CleanupRunRecord]:
            cur.execute("SELECT * FROM arroyo_cleanup_runs WHERE pipeline_id = %s ORDER BY id DESC LIMIT %s",
                        (pipeline_id, limit))
            return [from_row(CleanupRunRecord, r) for r in cur.fetchall()]

        return self._db.tx(tx)

    def begin_prune(self, pipeline_id: str, cleanup_run: int, epochs: Sequence[int]) -> PrunePlan:
        """Mark ``epochs`` as ``pruning`` (while we hold the lease) and say what only they reference.

        The database re-checks the rules: only ended epochs move, never the latest completed one.
        Epochs left ``pruning`` by a crashed run are included again.
        """
        wanted = sorted({int(e) for e in epochs})

        def tx(cur: PgCursor) -> PrunePlan:
            pipe = lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            transition(cur, EpochState.PRUNING,
                       where="e.pipeline_id = %(p)s AND e.epoch = ANY(%(e)s) AND e.pin_label IS NULL"
                       " AND e.epoch IS DISTINCT FROM"
                       " (SELECT max(c.epoch) FROM arroyo_epochs c WHERE c.pipeline_id = %(p)s"
                       "  AND c.state = %(completed)s)",
                       params={"p": pipeline_id, "e": wanted, "completed": EpochState.COMPLETED.value})
            cur.execute(
                "SELECT epoch FROM arroyo_epochs WHERE pipeline_id = %s AND epoch = ANY(%s) AND state = 'pruning'"
                " ORDER BY epoch",
                (pipeline_id, wanted),
            )
            marked = [int(r["epoch"]) for r in cur.fetchall()]
            cur.execute(
                "SELECT o.object_key, o.bytes FROM arroyo_objects o WHERE o.pipeline_id = %(p)s"
                " AND EXISTS (SELECT 1 FROM arroyo_epoch_objects eo WHERE eo.pipeline_id = o.pipeline_id"
                "   AND eo.object_key = o.object_key AND eo.epoch = ANY(%(e)s))"
                " AND NOT EXISTS (SELECT 1 FROM arroyo_epoch_objects eo JOIN arroyo_epochs ep"
                "   USING (pipeline_id, epoch) WHERE eo.pipeline_id = o.pipeline_id"
                "   AND eo.object_key = o.object_key AND ep.state NOT IN ('pruning', 'pruned'))"
                " ORDER BY o.object_key",
                {"p": pipeline_id, "e": marked},
            )
            objects = [(r["object_key"], int(r["bytes"])) for r in cur.fetchall()]
            # The oldest position any restorable (completed, not pruning) epoch resumes a channel at; pinned epochs
            # are completed ones (a superseded one cannot be restored: its channels were cut).
            cur.execute(
                "SELECT c.key AS channel, min((c.value)::text::bigint) AS pos"
                " FROM arroyo_acks a JOIN arroyo_epochs e USING (pipeline_id, epoch)"
                " CROSS JOIN LATERAL jsonb_each(a.cursors) c"
                " WHERE a.pipeline_id = %s AND e.state = 'completed' GROUP BY c.key",
                (pipeline_id,),
            )
            channels: dict[str, str] = pipe["channels"] or {}
            low = {channels.get(r["channel"], r["channel"]): int(r["pos"]) for r in cur.fetchall()}
            return PrunePlan(epochs=marked, objects=objects, channel_low_watermarks=low,
                             storage_uri=pipe["storage_uri"])

        return self._db.tx(tx)

    def finish_prune(self, pipeline_id: str, cleanup_run: int, bytes_freed: Mapping[int, int]) -> list[int]:
        """Mark the ``pruning`` epochs in ``bytes_freed`` as ``pruned``, forget the objects that no
        epoch references any more and add the figures to the cleanup run. Needs the lease."""
        epochs = sorted(int(e) for e in bytes_freed)

        def tx(cur: PgCursor) -> list[int]:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            done: list[int] = []
            for epoch in epochs:
                if transition(cur, EpochState.PRUNED, where="e.pipeline_id = %(p)s AND e.epoch = %(n)s",
                              also="pruned_at = clock_timestamp(), bytes_freed = %(freed)s",
                              params={"p": pipeline_id, "n": epoch, "freed": int(bytes_freed[epoch])}):
                    done.append(epoch)
            cur.execute("DELETE FROM arroyo_epoch_objects WHERE pipeline_id = %s AND epoch = ANY(%s)",
                        (pipeline_id, done))
            cur.execute(
                "DELETE FROM arroyo_objects o WHERE o.pipeline_id = %s AND NOT EXISTS"
                " (SELECT 1 FROM arroyo_epoch_objects eo WHERE eo.pipeline_id = o.pipeline_id"
                "  AND eo.object_key = o.object_key)",
                (pipeline_id,),
            )
            cur.execute(
                "UPDATE arroyo_cleanup_runs SET epochs_pruned = epochs_pruned || %s::bigint[],"
                " bytes_freed = bytes_freed + %s WHERE id = %s",
                (done, sum(int(bytes_freed[e]) for e in done), cleanup_run),
            )
            return done

        return self._db.tx(tx)

    def unpruned_epochs(self, pipeline_id: str) -> list[EpochRecord]:
        """Every epoch of a pipeline not yet pruned, oldest first (input of the retention policy)."""

        def tx(cur: PgCursor) -> list[EpochRecord]:
            cur.execute(
                f"SELECT {_EPOCH_COLS} FROM arroyo_epochs WHERE pipeline_id = %s AND state <> 'pruned'"  # noqa: S608
                " ORDER BY epoch",
                (pipeline_id,),
            )
            rows = cur.fetchall()
            if not rows:
                read_pipeline(cur, pipeline_id)
            return [from_row(EpochRecord, r) for r in rows]

        return self._db.tx(tx)

    # ------------------------------------------------------------------ sink commits

    # ------------------------------------------------------------------ compaction (bounded store)

    def begin_compaction(self, pipeline_id: str, cleanup_run: int, horizon: timedelta) -> CompactionCut | None:
        """Choose where to cut the pipeline's history and record it in ``arroyo_history_base``; needs the lease.

        The cut is the newest lease release older than ``horizon`` that is a transaction of its own (not
        a takeover), so no lease was held there. Returns None when there is no such release beyond the
        previous cut (nothing new to compact). The deletions themselves are :meth:`compact_batch`.
        """
        if not isinstance(horizon, timedelta) or horizon < timedelta(0):
            raise ConfigurationError(f"compaction horizon must be a duration >= 0, got {horizon!r}")

        def tx(cur: PgCursor) -> CompactionCut | None:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute("SELECT * FROM arroyo_history_base WHERE pipeline_id = %s", (pipeline_id,))
            base = cur.fetchone()
            cur.execute(
                "SELECT h.seq, h.at, h.cleanup_run FROM arroyo_history h"
                " WHERE h.pipeline_id = %(p)s AND h.seq > %(after)s AND h.kind = 'lock_released'"
                " AND h.at < clock_timestamp() - %(horizon)s AND h.cleanup_run IS NOT NULL"
                " AND (SELECT o.txid FROM arroyo_history o WHERE o.pipeline_id = h.pipeline_id AND o.seq > h.seq"
                "      ORDER BY o.seq LIMIT 1) IS DISTINCT FROM h.txid"
                " AND (SELECT o.txid FROM arroyo_history o WHERE o.pipeline_id = h.pipeline_id AND o.seq < h.seq"
                "      ORDER BY o.seq DESC LIMIT 1) IS DISTINCT FROM h.txid"
                " ORDER BY h.seq DESC LIMIT 1",
                {"p": pipeline_id, "after": int(base["through_seq"]) if base else 0, "horizon": horizon},
            )
            cut = cur.fetchone()
            if cut is None:
                return None
            cur.execute(
                "SELECT COALESCE(max(epoch), 0) AS m FROM arroyo_history WHERE pipeline_id = %s AND seq <= %s"
                " AND kind = 'epoch_state' AND old_state IS NULL",
                (pipeline_id, cut["seq"]),
            )
            max_epoch = max(int(one(cur)["m"]), int(base["max_epoch"]) if base else 0)
            cur.execute(
                "INSERT INTO arroyo_history_base (pipeline_id, through_seq, max_epoch, cut_at, cleanup_run)"
                " VALUES (%(p)s, %(seq)s, %(max)s, %(at)s, %(run)s) ON CONFLICT (pipeline_id) DO UPDATE SET"
                " through_seq = EXCLUDED.through_seq, max_epoch = EXCLUDED.max_epoch, cut_at = EXCLUDED.cut_at,"
                " cleanup_run = EXCLUDED.cleanup_run, compacted_at = clock_timestamp()",
                {"p": pipeline_id, "seq": cut["seq"], "max": max_epoch, "at": cut["at"], "run": cut["cleanup_run"]},
            )
            return CompactionCut(through_seq=int(cut["seq"]), max_epoch=max_epoch, cut_at=cut["at"],
                                 cleanup_run=int(cut["cleanup_run"]))

        return self._db.tx(tx)

    _COMPACT_SQL = {
        # epochs pruned before the cut (their acks go with them: ON DELETE CASCADE); pruned is final
        "epochs": "DELETE FROM arroyo_epochs WHERE pipeline_id = %(p)s AND epoch IN (SELECT epoch FROM arroyo_epochs"
                  " WHERE pipeline_id = %(p)s AND state = 'pruned' AND pruned_at < %(at)s ORDER BY pruned_at"
                  " LIMIT %(n)s)",
        # the sink commits of the epochs "epochs" deletes (or deleted), before it: each sink's newest stays (the
        # outlets' latest_sink_commit, a new watcher's start); a watcher further behind than the cut misses them
        "sink_commits": "DELETE FROM arroyo_sink_commits WHERE seq IN (SELECT s.seq FROM arroyo_sink_commits s"
                        " WHERE s.pipeline_id = %(p)s AND NOT EXISTS (SELECT 1 FROM arroyo_epochs e"
                        "  WHERE e.pipeline_id = s.pipeline_id AND e.epoch = s.epoch"
                        "  AND (e.state <> 'pruned' OR e.pruned_at >= %(at)s))"
                        " AND s.epoch < (SELECT max(m.epoch) FROM arroyo_sink_commits m"
                        "  WHERE m.pipeline_id = s.pipeline_id AND m.sink = s.sink)"
                        " ORDER BY s.seq LIMIT %(n)s)",
        "history": "DELETE FROM arroyo_history WHERE pipeline_id = %(p)s AND seq IN (SELECT seq FROM arroyo_history"
                   " WHERE pipeline_id = %(p)s AND seq <= %(seq)s ORDER BY seq LIMIT %(n)s)",
        # every run up to the cut's has ended: the cut's run held the lease after them
        "cleanup_runs": "DELETE FROM arroyo_cleanup_runs WHERE id IN (SELECT id FROM arroyo_cleanup_runs"
                        " WHERE pipeline_id = %(p)s AND id <= %(run)s AND state <> 'running' ORDER BY id"
                        " LIMIT %(n)s)",
    }

    def compact_batch(self, pipeline_id: str, cleanup_run: int, cut: CompactionCut, table: str, limit: int) -> int:
        """Delete at most ``limit`` rows of ``table`` (``sink_commits``, ``epochs``, ``history`` or
        ``cleanup_runs``) that ``cut`` leaves behind, in one short transaction under the lease; returns how many
        went."""
        sql = self._COMPACT_SQL.get(table)
        if sql is None:
            raise ConfigurationError(f"cannot compact {table!r}: choose one of {sorted(self._COMPACT_SQL)}")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ConfigurationError(f"compaction batch size must be a whole number >= 1, got {limit!r}")

        def tx(cur: PgCursor) -> int:
            lock_pipeline(cur, pipeline_id)
            self._check_lease(cur, pipeline_id, cleanup_run)
            cur.execute(sql, {"p": pipeline_id, "at": cut.cut_at, "seq": cut.through_seq, "run": cut.cleanup_run,
                              "n": limit})
            return int(cur.rowcount)

        return self._db.tx(tx)

    def db_now(self) -> datetime:
        def tx(cur: PgCursor) -> datetime:
            cur.execute("SELECT clock_timestamp() AS now")
            now: datetime = one(cur)["now"]
            return now

        return self._db.tx(tx)



__all__ = ["EpochStore", "TriggerDecision", "redact_dsn"]
