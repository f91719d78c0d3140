"""The checkpoint controller's ticks: each pipeline's decision (:func:`~airflow_arroyo.core.epochs.decide_trigger`)
read and applied under its row lock, many pipelines in one transaction (a triggerer's due ticks, coalesced).

The batch runs the same few statements every tick, prepared once per connection
(:mod:`~airflow_arroyo.store._prepared`), and builds their rows in C (:func:`~airflow_arroyo.store._db.dict_rows`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from contextlib import suppress
from typing import Any

import psycopg2
import psycopg2.extras
from psycopg2.extensions import cursor as PgRawCursor

from airflow_arroyo.core.epochs import (
    CheckpointPolicy,
    CleanupLease,
    EpochState,
    PipelineState,
    TriggerAction,
    TriggerDecision,
    TriggerFacts,
    consecutive_failures,
    decide_trigger,
)
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    ConfigurationError,
    StoreError,
    TransientStoreError,
    UnknownPipelineError,
)
from airflow_arroyo.store._db import Concern, PgCursor, dict_rows
from airflow_arroyo.store._prepared import Prepared, execute_prepared
from airflow_arroyo.store._transitions import transition
from airflow_arroyo.store.records import EPOCH_COLUMNS, EpochRecord, TickRequest, TickResult, epoch_columns, from_row

__all__ = ["Ticks"]

_EPOCH_COLS = epoch_columns()
# The batch's pipeline row locks: waiting for them, or skipping rows another transaction holds.
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
# The locks, the existence check, the facts and the ended watched epochs in one call (migration 0016).
_TICK_LOCK_FACTS = Prepared(
    "arroyo_tick_lock_facts", ("text[]", "text[]", "text[]", "int[]", "text[]", "bigint[]"),
    "SELECT * FROM arroyo_tick_lock_facts($1, $2, $3, $4, $5, $6)",
)
# True: a batch's locks, facts and watched epochs are one round trip (arroyo_tick_lock_facts); False: four
# statements, as before migration 0016 (kept for benchmarks/trigger_load.py's side-by-side comparison).
ONE_CALL = True

# locked pipeline rows, unknown pipelines, facts per locked pipeline, ended watched epochs, when they were read
_Locked = tuple[dict[str, dict[str, Any]], set[str], dict[str, dict[str, Any]], dict[str, tuple[EpochRecord, ...]],
                float]
# an ended epoch's row of arroyo_tick_lock_facts: EpochRecord's fields in its e_ columns
_ENDED_COLUMNS = tuple((name, f"e_{name}") for name in EPOCH_COLUMNS)


class Ticks(Concern):
    """The controller's side of the epoch life cycle: starting epochs and expiring the overdue one."""

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
        if ONE_CALL:
            return self._db.retried(lambda: self._one_call_tx(requests))

        def tx(cur: PgCursor) -> list[TickResult | ArroyoError | None]:
            with cur.connection.cursor() as raw:  # the batch's own statements: rows built by dict_rows
                return self._ticks(cur, raw, requests)

        return self._db.tx(tx)

    def _one_call_tx(self, requests: Sequence[TickRequest]) -> list[TickResult | ArroyoError | None]:
        """The batch's transaction with BEGIN sent in the round trip of its first statement (psycopg2 would send
        it alone): the connection is in autocommit and the transaction is the batch's own, BEGIN to COMMIT."""
        with self._db.connection() as conn:
            conn.autocommit = True
            try:
                with conn.cursor(cursor_factory=psycopg2.extras.RealDictCursor) as cur, conn.cursor() as raw:
                    try:
                        out = self._ticks(cur, raw, requests)
                        raw.execute("COMMIT")
                    except BaseException:
                        if not conn.closed:  # not left open for the pool (which would close the connection)
                            with suppress(psycopg2.Error):
                                raw.execute("ROLLBACK")
                        raise
                return out
            finally:
                if not conn.closed:
                    conn.autocommit = False

    def _ticks(self, cur: PgCursor, raw: PgRawCursor, requests: Sequence[TickRequest]
               ) -> list[TickResult | ArroyoError | None]:
        out: list[TickResult | ArroyoError | None] = [None] * len(requests)
        if ONE_CALL:
            pipes, unknown, facts, watched, observed_at = self._lock_facts_one_call(raw, requests)
        else:
            pipes, unknown, facts, watched, observed_at = self._lock_facts_separately(cur, raw, requests)
        for i, r in enumerate(requests):
            if r.pipeline_id in unknown:
                out[i] = UnknownPipelineError(r.pipeline_id)
        todo = [(i, r) for i, r in enumerate(requests) if r.pipeline_id in pipes]
        if not todo:
            return out
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
    def _lock_facts_one_call(raw: PgRawCursor, requests: Sequence[TickRequest]) -> _Locked:
        """The batch's row locks, which pipelines exist, and every locked pipeline's facts and ended watched
        epochs in one round trip (``arroyo_tick_lock_facts``, migration 0016; the same statements as
        :meth:`_lock_facts_separately`, each with a fresh snapshot)."""
        pairs = sorted({(r.pipeline_id, int(e)) for r in requests for e in r.watch})
        t0 = time.monotonic()
        execute_prepared(raw, _TICK_LOCK_FACTS, (
            sorted(r.pipeline_id for r in requests if not r.skip_if_locked),
            sorted(r.pipeline_id for r in requests if r.skip_if_locked),
            [r.pipeline_id for r in requests], [r.policy.tolerable_failures + 2 for r in requests],
            [p for p, _ in pairs], [e for _, e in pairs]), prefix="BEGIN; ")
        rows = dict_rows(raw)
        observed_at = (t0 + time.monotonic()) / 2
        pipes: dict[str, dict[str, Any]] = {}
        unknown: set[str] = set()
        watched: dict[str, tuple[EpochRecord, ...]] = {}
        for row in rows:
            pid = row["pipeline_id"]
            if row["e_epoch"] is not None:  # a watched epoch that ended (in epoch order)
                rec = EpochRecord(**{name: row[key] for name, key in _ENDED_COLUMNS})
                watched[pid] = (*watched.get(pid, ()), rec)
            elif not row["found"]:
                unknown.add(pid)
            elif row["locked"]:
                pipes[pid] = row
        return pipes, unknown, pipes, watched, observed_at

    def _lock_facts_separately(self, cur: PgCursor, raw: PgRawCursor, requests: Sequence[TickRequest]) -> _Locked:
        """:meth:`_lock_facts_one_call` as separate statements: the locks, the existence of the pipelines not
        locked, the facts, the watched epochs (``ONE_CALL = False``: the path before migration 0016)."""
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
        unknown: set[str] = set()
        if missing:
            cur.execute("SELECT pipeline_id FROM arroyo_pipelines WHERE pipeline_id = ANY(%s)", (missing,))
            exist = {row["pipeline_id"] for row in cur.fetchall()}  # locked by another: skipped
            unknown = set(missing) - exist
        locked = [r for r in requests if r.pipeline_id in pipes]
        if not locked:
            return pipes, unknown, {}, {}, 0.0
        facts, watched, observed_at = Ticks._tick_facts(raw, locked)
        return pipes, unknown, facts, watched, observed_at

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

