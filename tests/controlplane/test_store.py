"""The epoch store's own behaviour, against a real PostgreSQL started by the suite.

Schema (migrations, CHECK constraints, the one-in-flight index, increasing epochs), life cycles
(pipeline transitions exhaustively, epoch transitions through every store operation), acks, runs,
the cleanup lease, errors (typed, bad input refused before anything is written, transient ones
retried across a server restart, permanent ones raised at once) and two races found here.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg2
import psycopg2.errors
import pytest

from airflow_arroyo.core.epochs import (
    EPOCH_TRANSITIONS,
    PIPELINE_TRANSITIONS,
    CheckpointPolicy,
    EpochState,
    PipelineState,
    TriggerAction,
    schedule_phase,
    schedule_point_after,
)
from airflow_arroyo.core.exceptions import (
    CleanupLockHeld,
    ConcurrencyConflict,
    ConfigurationError,
    IllegalTransitionError,
    LockLostError,
    SchemaError,
    SchemaMissingError,
    StoreError,
    TransientStoreError,
    UnknownEpochError,
    UnknownPipelineError,
)
from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import AckOutcome, AckResult, EpochStore, SnapshotEntry, available_migrations, is_transient
from airflow_arroyo.store._migrate import _LOCK_KEY, checksum
from airflow_arroyo.testing import wait_for
from tests.support import running, sql

# ----------------------------------------------------------------------------- helpers


def count(dsn: str, table: str) -> int:
    return int(sql(dsn, f"SELECT count(*) FROM {table}")[0][0])  # noqa: S608 - test helper, constant names


def lock_waiters(dsn: str) -> int:
    """Backends of this database waiting for a lock right now."""
    return int(sql(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'")[0][0])


FAST = CheckpointPolicy(interval=0.05, timeout=0.05)
SLOW = CheckpointPolicy(interval=3600, timeout=3600)


def start(store: EpochStore, pipeline_id: str) -> int:
    started = store.trigger_tick(pipeline_id, SLOW, force=True).started
    assert started is not None
    return started.epoch


def complete(store: EpochStore, pipeline_id: str) -> int:
    epoch = start(store, pipeline_id)
    for stage in store.get_epoch(pipeline_id, epoch).stages:
        store.ack_epoch(pipeline_id, epoch, stage)
    return epoch


def expire(store: EpochStore, pipeline_id: str) -> int:
    started = store.trigger_tick(pipeline_id, FAST, force=True).started
    assert started is not None
    wait_for(lambda: store.db_now() > started.timeout_at, what="the epoch to pass its timeout")
    tick = store.trigger_tick(pipeline_id, FAST)
    assert tick.decision.action is TriggerAction.EXPIRE and tick.expired is not None
    return started.epoch


@pytest.fixture(scope="module")
def shared_dsn(migrated_db: Callable[[str], str]) -> str:
    """One migrated database for the tests that each use their own pipelines."""
    return migrated_db("store")


@pytest.fixture(scope="module")
def shared(shared_dsn: str) -> Iterator[EpochStore]:
    s = EpochStore(shared_dsn)
    try:
        yield s
    finally:
        s.close()


_ids = itertools.count(1)


def new_id(prefix: str = "p") -> str:
    return f"{prefix}-{next(_ids)}"


# ============================================================================= schema


def test_migrations_are_idempotent(store: EpochStore, migrated_dsn: str) -> None:
    versions = [v for v, _, _ in available_migrations()]
    assert store.schema_version() == max(versions)
    assert store.migrate() == []
    assert store.migrate() == []
    assert sorted(r[0] for r in sql(migrated_dsn, "SELECT version FROM arroyo_schema_migrations")) == versions


def test_migrations_from_two_processes_at_once_apply_each_version_once(pg_dsn: str) -> None:
    """Both processes queue on the migration lock (held here until both wait), then race."""
    code = ("import json, sys; from airflow_arroyo.store import EpochStore; s = EpochStore(sys.argv[1]);"
            " print(json.dumps(s.migrate())); s.close()")
    holder = psycopg2.connect(pg_dsn)
    try:
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(%s)", (_LOCK_KEY,))
        procs = [subprocess.Popen([sys.executable, "-c", code, pg_dsn], stdout=subprocess.PIPE, text=True)
                 for _ in range(2)]
        wait_for(lambda: int(sql(pg_dsn, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                           " AND NOT granted")[0][0]) == 2,
                   timeout=60, what="both processes to wait for the migration lock")
        with holder.cursor() as cur:
            cur.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_KEY,))
        outputs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        holder.close()
    assert [p.returncode for p in procs] == [0, 0]
    versions = [v for v, _, _ in available_migrations()]
    assert sorted((json.loads(o) for o in outputs), key=len) == [[], versions]
    assert sorted(r[0] for r in sql(pg_dsn, "SELECT version FROM arroyo_schema_migrations")) == versions


def _migrations(dsn: str) -> list[tuple[int, str | None]]:
    return [(int(v), c) for v, c in sql(dsn, "SELECT version, checksum FROM arroyo_schema_migrations ORDER BY 1")]


def test_checksums_are_recorded_and_backfilled_for_rows_written_before_them(store: EpochStore) -> None:
    shipped = [(v, checksum(text)) for v, _, text in available_migrations()]
    assert _migrations(store.dsn) == shipped
    # a store migrated by a release that recorded no checksums: no column at all, then NULLs
    sql(store.dsn, "ALTER TABLE arroyo_schema_migrations DROP COLUMN checksum")
    assert store.check_schema() == shipped[-1][0]  # versions alone are checked
    assert store.migrate() == []
    assert _migrations(store.dsn) == shipped
    sql(store.dsn, "UPDATE arroyo_schema_migrations SET checksum = NULL")
    assert store.migrate() == [] and _migrations(store.dsn) == shipped


def test_a_newer_or_edited_schema_is_refused_before_anything_is_written(store: EpochStore) -> None:
    first, last = available_migrations()[0], available_migrations()[-1]
    sql(store.dsn, "INSERT INTO arroyo_schema_migrations (version, name, checksum) VALUES (%s, %s, 'x')",
        (last[0] + 1, f"{last[0] + 1:04d}_from_the_future.sql"))
    before = _migrations(store.dsn)
    for call in (store.migrate, store.check_schema):
        with pytest.raises(SchemaError, match=f"{last[0] + 1:04d}_from_the_future.sql.*upgrade airflow-arroyo"):
            call()
    assert _migrations(store.dsn) == before
    sql(store.dsn, "DELETE FROM arroyo_schema_migrations WHERE version = %s", (last[0] + 1,))
    sql(store.dsn, "UPDATE arroyo_schema_migrations SET checksum = %s WHERE version = %s",
        (checksum(first[2] + "-- edited\n"), first[0]))
    for call in (store.migrate, store.check_schema):
        with pytest.raises(SchemaError, match=f"migration {first[1]} applied to this epoch store differs"):
            call()


def test_check_schema_names_what_to_run(pg_server: ThrowawayPostgres, store: EpochStore) -> None:
    empty = EpochStore(pg_server.create_database(f"empty_{uuid.uuid4().hex[:12]}"))
    try:
        with pytest.raises(SchemaMissingError, match="has no airflow-arroyo schema: run `airflow-arroyo migrate`"):
            empty.check_schema()
        assert empty.check_schema(complete=False) == 0
    finally:
        empty.close()
    last = available_migrations()[-1]
    sql(store.dsn, "DELETE FROM arroyo_schema_migrations WHERE version = %s", (last[0],))  # as if one release behind
    behind = f"this package needs {last[0]} \\(it lacks {last[1]}\\): run `airflow-arroyo migrate`"
    with pytest.raises(SchemaMissingError, match=behind):
        store.check_schema()
    assert store.check_schema(complete=False) == available_migrations()[-2][0]  # versions may skip a number


CHECKS = {
    "pipeline state": ("INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('x', 'paused')", ()),
    "pipeline id": ("INSERT INTO arroyo_pipelines (pipeline_id) VALUES ('a/b')", ()),
    "stop request": ("UPDATE arroyo_pipelines SET stop_requested = 'later' WHERE pipeline_id = 'ok'", ()),
    "checkpoint interval": ("UPDATE arroyo_pipelines SET checkpoint_interval_s = 0 WHERE pipeline_id = 'ok'", ()),
    "epoch state": ("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                    " VALUES ('ok', 1, 'done', '{s}', now() + interval '1 hour')", ()),
    "epoch number": ("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                     " VALUES ('ok', 0, 'triggered', '{s}', now() + interval '1 hour')", ()),
    "ended without end time": ("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                               " VALUES ('ok', 1, 'completed', '{s}', now() + interval '1 hour')", ()),
    "in flight with end time": ("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at, ended_at)"
                                " VALUES ('ok', 1, 'triggered', '{s}', now() + interval '1 hour', now())", ()),
    "timeout before trigger": ("INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                               " VALUES ('ok', 1, 'triggered', '{s}', now() - interval '1 second')", ()),
    "cleanup run state": ("INSERT INTO arroyo_cleanup_runs (pipeline_id, holder, state) VALUES ('ok', 'h', 'done')",
                          ()),
    "lease ends before it starts": ("INSERT INTO arroyo_cleanup_locks (pipeline_id, cleanup_run, holder, expires_at)"
                                    " VALUES ('ok', 1, 'h', now() - interval '1 second')", ()),
}


@pytest.mark.parametrize("case", list(CHECKS))
def test_check_constraints_refuse_invalid_rows(shared_dsn: str, case: str) -> None:
    query, params = CHECKS[case]
    sql(shared_dsn, "INSERT INTO arroyo_pipelines (pipeline_id, state) VALUES ('ok', 'running')"
                    " ON CONFLICT DO NOTHING")
    with pytest.raises(psycopg2.errors.CheckViolation):
        sql(shared_dsn, query, params)


def test_a_second_in_flight_epoch_is_refused_even_by_raw_sql(store: EpochStore, migrated_dsn: str) -> None:
    running(store, "one")
    running(store, "other")
    first = start(store, "one")
    with pytest.raises(psycopg2.errors.UniqueViolation, match="arroyo_epochs_one_in_flight"):
        sql(migrated_dsn, "INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                    " VALUES ('one', %s, 'triggered', '{src}', now() + interval '1 hour')", (first + 1,))
    start(store, "other")  # another pipeline has its own
    assert store.trigger_tick("one", SLOW, force=True).decision.action is TriggerAction.WAIT_IN_FLIGHT


def test_epoch_numbers_must_increase_even_for_raw_sql(store: EpochStore, migrated_dsn: str) -> None:
    running(store, "inc")
    complete(store, "inc")
    complete(store, "inc")
    for epoch in (1, 2):
        with pytest.raises(psycopg2.errors.CheckViolation, match="not greater than every earlier epoch"):
            sql(migrated_dsn, "INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                        " VALUES ('inc', %s, 'triggered', '{src}', now() + interval '1 hour')", (epoch,))
    assert start(store, "inc") == 3


# ============================================================================= life cycles


def test_pipeline_transitions_follow_the_table_exhaustively(shared: EpochStore, shared_dsn: str) -> None:
    for current, target in itertools.product(PipelineState, PipelineState):
        pid = new_id("pt")
        shared.register_pipeline(pid, stages=["s"], run_id="r")
        sql(shared_dsn, "UPDATE arroyo_pipelines SET state = %s WHERE pipeline_id = %s", (current.value, pid))
        if target in PIPELINE_TRANSITIONS[current]:
            assert shared.set_pipeline_state(pid, target).state is target
        else:
            with pytest.raises(IllegalTransitionError, match=f"'{current.value}' -> '{target.value}'"):
                shared.set_pipeline_state(pid, target)
            assert shared.get_pipeline(pid).state is current


@pytest.mark.parametrize("target", [PipelineState.STOPPED, PipelineState.FAILED])
def test_a_pipeline_that_ends_fails_its_in_flight_epoch(store: EpochStore, target: PipelineState) -> None:
    running(store, "ends")
    epoch = start(store, "ends")
    store.set_pipeline_state("ends", target, failure_cause="driver crashed" if target is PipelineState.FAILED else None)
    rec = store.get_epoch("ends", epoch)
    assert rec.state is EpochState.FAILED
    assert rec.failure_reason == f"pipeline {target.value}"


def test_a_stale_run_cannot_change_the_pipeline(store: EpochStore) -> None:
    running(store, "stale", run_id="r1")
    with pytest.raises(ConcurrencyConflict, match="superseded"):
        store.set_pipeline_state("stale", PipelineState.STOPPING, run_id="r0")
    with pytest.raises(ConcurrencyConflict, match="no longer current"):
        store.heartbeat("stale", "r0")
    assert store.heartbeat("stale", "r1").state is PipelineState.RUNNING
    assert store.get_pipeline("stale").state is PipelineState.RUNNING


# What each store operation tries to do to an epoch, and the state it aims at.
def _op_complete(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    for stage in s.get_epoch(pid, epoch).stages:
        s.ack_epoch(pid, epoch, stage)


def _op_fail(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    s.fail_epoch(pid, epoch, "test")


def _op_begin_prune(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    s.begin_prune(pid, run, [epoch])


def _op_finish_prune(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    s.finish_prune(pid, run, {epoch: 0})


def _op_expire(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    # epoch 2 passed its timeout an hour ago; a tick expires it if it is the one in flight
    sql(s, "UPDATE arroyo_epochs SET triggered_at = triggered_at - interval '2 hours',"
           " timeout_at = now() - interval '1 hour' WHERE pipeline_id = %s AND epoch = %s", (pid, epoch))
    s.trigger_tick(pid, SLOW)


def _op_pipeline_fails(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    s.set_pipeline_state(pid, PipelineState.FAILED, failure_cause="test")


def _op_restore_older(s: EpochStore, pid: str, epoch: int, run: int) -> None:
    s.commit_restore(pid, "r", epoch - 1)


OPERATIONS: dict[str, tuple[Callable[[EpochStore, str, int, int], None], EpochState]] = {
    "ack every stage": (_op_complete, EpochState.COMPLETED),
    "fail_epoch": (_op_fail, EpochState.FAILED),
    "begin_prune": (_op_begin_prune, EpochState.PRUNING),
    "finish_prune": (_op_finish_prune, EpochState.PRUNED),
    "trigger tick past the timeout": (_op_expire, EpochState.EXPIRED),
    "the pipeline fails": (_op_pipeline_fails, EpochState.FAILED),
    "commit_restore of an older epoch": (_op_restore_older, EpochState.SUPERSEDED),
}


@pytest.mark.parametrize(("start_state", "operation"), list(itertools.product(EpochState, OPERATIONS)))
def test_store_operations_move_epochs_only_along_legal_transitions(
        shared: EpochStore, shared_dsn: str, start_state: EpochState, operation: str) -> None:
    """Every operation on an epoch in every state: it moves the epoch to its target state if and only
    if the transition table allows it, and leaves it alone otherwise (a newer completed epoch exists,
    so the 'never the latest completed' rule is not what stops begin_prune)."""
    pid = new_id("et")
    shared.register_pipeline(pid, stages=["a", "b"], run_id="r")
    ended = "NULL" if start_state is EpochState.TRIGGERED else "now()"
    sql(shared_dsn,
        f"INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at, ended_at)"  # noqa: S608
        f" VALUES (%(p)s, 1, 'completed', '{{a,b}}', now() + interval '1 hour', now()),"
        f" (%(p)s, 2, %(s)s, '{{a,b}}', now() + interval '1 hour', {ended})",
        {"p": pid, "s": start_state.value})
    if start_state is not EpochState.TRIGGERED:
        sql(shared_dsn, "INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at, ended_at)"
                        " VALUES (%s, 3, 'completed', '{a,b}', now() + interval '1 hour', now())", (pid,))
    run = shared.acquire_cleanup_lock(pid, "test", ttl=60).id
    fn, target = OPERATIONS[operation]
    fn(shared, pid, 2, run)
    expected = target if target in EPOCH_TRANSITIONS[start_state] else start_state
    assert shared.get_epoch(pid, 2).state is expected
    changes = sql(shared_dsn, "SELECT old_state, new_state FROM arroyo_history WHERE pipeline_id = %s"
                              " AND epoch = 2 AND old_state IS NOT NULL", (pid,))
    assert changes == ([] if expected is start_state else [(start_state.value, target.value)])


def test_begin_prune_never_marks_the_latest_completed_or_an_in_flight_epoch(store: EpochStore) -> None:
    running(store, "keep")
    first, latest = complete(store, "keep"), complete(store, "keep")
    in_flight = start(store, "keep")
    run = store.acquire_cleanup_lock("keep", "test", ttl=60).id
    plan = store.begin_prune("keep", run, [first, latest, in_flight])
    assert plan.epochs == [first]
    assert store.get_epoch("keep", latest).state is EpochState.COMPLETED
    assert store.get_epoch("keep", in_flight).state is EpochState.TRIGGERED
    assert store.finish_prune("keep", run, {first: 10}) == [first]
    closed = store.release_cleanup_lock("keep", run)
    assert (closed.state, closed.epochs_pruned, closed.bytes_freed) == ("succeeded", [first], 10)


def test_begin_prune_lists_only_objects_no_retained_epoch_references(store: EpochStore) -> None:
    running(store, "objs", stages=["s"])
    old = start(store, "objs")
    store.record_snapshot("objs", old, "s", [SnapshotEntry("state/1", "shared", 5),
                                             SnapshotEntry("o/1", "only-old", 7)])
    store.ack_epoch("objs", old, "s")
    new = start(store, "objs")
    store.record_snapshot("objs", new, "s", [SnapshotEntry("state/1", "shared", 5),
                                             SnapshotEntry("o/2", "only-new", 3)])
    store.ack_epoch("objs", new, "s")
    run = store.acquire_cleanup_lock("objs", "test", ttl=60).id
    plan = store.begin_prune("objs", run, [old])
    assert plan.objects == [("only-old", 7)]
    store.finish_prune("objs", run, {old: 7})
    assert store.known_objects("objs", ["shared", "only-old", "only-new"]) == {"shared", "only-new"}


# ============================================================================= acknowledgements


def test_acks_are_idempotent_and_complete_the_epoch_only_when_every_stage_acked(store: EpochStore,
                                                                                 migrated_dsn: str) -> None:
    running(store, "acks", stages=["a", "b", "c"])
    epoch = start(store, "acks")
    assert store.ack_epoch("acks", epoch, "a", bytes_new=10, bytes_total=100) is EpochState.TRIGGERED
    assert store.ack_epoch("acks", epoch, "a", bytes_new=99, bytes_total=999) is EpochState.TRIGGERED  # kept: first
    assert store.ack_epoch("acks", epoch, "b", bytes_new=20, bytes_total=200) is EpochState.TRIGGERED
    assert store.get_epoch("acks", epoch).state is EpochState.TRIGGERED
    assert store.ack_epoch("acks", epoch, "c", bytes_new=30, bytes_total=300) is EpochState.COMPLETED
    assert store.ack_epoch("acks", epoch, "c") is EpochState.COMPLETED
    rec = store.get_epoch("acks", epoch)
    assert (rec.state, rec.bytes_new, rec.bytes_total) == (EpochState.COMPLETED, 60, 600)
    assert sorted(a.stage for a in store.acks("acks", epoch)) == ["a", "b", "c"]
    completions = sql(migrated_dsn, "SELECT count(*) FROM arroyo_history WHERE pipeline_id = 'acks' AND epoch = %s"
                              " AND new_state = 'completed'", (epoch,))
    assert completions == [(1,)]


def test_an_ack_for_an_unknown_stage_or_epoch_writes_nothing(store: EpochStore, migrated_dsn: str) -> None:
    running(store, "bad-ack", stages=["a"])
    epoch = start(store, "bad-ack")
    with pytest.raises(ConfigurationError, match="not one of the stages"):
        store.ack_epoch("bad-ack", epoch, "z")
    with pytest.raises(UnknownEpochError, match="no epoch 99"):
        store.ack_epoch("bad-ack", 99, "a")
    assert count(migrated_dsn, "arroyo_acks") == 0


def test_an_ack_after_expiry_is_kept_but_the_epoch_stays_expired(store: EpochStore) -> None:
    running(store, "late", stages=["a", "b"])
    epoch = expire(store, "late")
    assert store.ack_epoch("late", epoch, "a") is EpochState.EXPIRED
    assert store.ack_epoch("late", epoch, "b") is EpochState.EXPIRED
    rec = store.get_epoch("late", epoch)
    assert rec.state is EpochState.EXPIRED
    assert rec.failure_reason is not None and "not acknowledged" in rec.failure_reason
    assert len(store.acks("late", epoch)) == 2
    assert store.fail_epoch("late", epoch, "too late") is EpochState.EXPIRED


def test_an_ack_answers_what_it_did(store: EpochStore) -> None:
    """As Flink's ``PendingCheckpoint.acknowledgeTask``: accepted, duplicate, completed the epoch, or too late
    (the epoch had already ended); with the epoch's state afterwards."""
    running(store, "answers", stages=["a", "b"])
    epoch = start(store, "answers")
    assert store.acknowledge("answers", epoch, "a") == AckResult(AckOutcome.ACCEPTED, EpochState.TRIGGERED)
    assert store.acknowledge("answers", epoch, "a") == AckResult(AckOutcome.DUPLICATE, EpochState.TRIGGERED)
    assert store.epochs.acknowledge("answers", epoch, "b") == AckResult(AckOutcome.COMPLETED_EPOCH,
                                                                        EpochState.COMPLETED)
    assert store.acknowledge("answers", epoch, "b") == AckResult(AckOutcome.DUPLICATE, EpochState.COMPLETED)
    late = expire(store, "answers")
    assert store.acknowledge("answers", late, "a") == AckResult(AckOutcome.EPOCH_ENDED, EpochState.EXPIRED)
    assert store.acknowledge("answers", late, "a") == AckResult(AckOutcome.DUPLICATE, EpochState.EXPIRED)
    assert [a.stage for a in store.acks("answers", late)] == ["a"]
    assert store.get_epoch("answers", late).state is EpochState.EXPIRED


def test_ack_racing_the_expiry_of_the_same_epoch_is_serialised(store: EpochStore, migrated_dsn: str) -> None:
    """A stage's last ack and the trigger's expiry of the same epoch arrive together: one of them wins,
    neither errors, and the history stays in commit order (every writer takes the pipeline lock)."""
    running(store, "race", stages=["s"])
    started = store.trigger_tick("race", FAST).started
    assert started is not None
    wait_for(lambda: store.db_now() > started.timeout_at, what="the epoch to pass its timeout")
    blocker = psycopg2.connect(migrated_dsn)
    try:
        with blocker.cursor() as cur:  # hold the epoch row so that both writers queue behind it
            cur.execute("SELECT 1 FROM arroyo_epochs WHERE pipeline_id = 'race' AND epoch = %s FOR UPDATE",
                        (started.epoch,))
        with ThreadPoolExecutor(2) as pool:
            ack = pool.submit(store.ack_epoch, "race", started.epoch, "s")
            wait_for(lambda: lock_waiters(migrated_dsn) >= 1, what="the ack to wait for a lock")
            tick = pool.submit(store.trigger_tick, "race", FAST)
            wait_for(lambda: lock_waiters(migrated_dsn) >= 2, what="the tick to wait for a lock")
            blocker.commit()
            ack_state = ack.result(timeout=30)
            tick_result = tick.result(timeout=30)
    finally:
        blocker.close()
    assert ack_state is EpochState.COMPLETED
    assert store.get_epoch("race", started.epoch).state is EpochState.COMPLETED
    assert tick_result.decision.action is not TriggerAction.EXPIRE
    check_history(migrated_dsn).assert_clean()


# ============================================================================= triggering


def test_trigger_tick_decisions(store: EpochStore) -> None:
    store.register_pipeline("tick", stages=["s"], run_id="r1")
    assert store.trigger_tick("tick", SLOW).decision.action is TriggerAction.PIPELINE_NOT_RUNNING
    store.set_pipeline_state("tick", PipelineState.RUNNING)
    first = store.trigger_tick("tick", SLOW)
    assert first.decision.action is TriggerAction.START and first.started is not None
    assert store.trigger_tick("tick", SLOW).decision.action is TriggerAction.WAIT_IN_FLIGHT
    store.ack_epoch("tick", first.started.epoch, "s")
    waiting = store.trigger_tick("tick", SLOW)
    assert waiting.decision.action is TriggerAction.WAIT_SCHEDULE
    assert waiting.decision.recheck_at == schedule_point_after(first.started.triggered_at, 3600,
                                                               schedule_phase("tick", 3600))
    forced = store.trigger_tick("tick", SLOW, force=True, triggered_by="manual")
    assert forced.started is not None and forced.started.triggered_by == "manual"
    store.fail_epoch("tick", forced.started.epoch, "x")
    expire(store, "tick")
    assert store.trigger_tick("tick", SLOW).consecutive_failures == 2
    store.set_pipeline_state("tick", PipelineState.STOPPED)
    assert store.trigger_tick("tick", SLOW).decision.action is TriggerAction.PIPELINE_ENDED


def test_a_graceful_stops_final_epoch_is_the_only_one_that_starts_while_stopping(store: EpochStore) -> None:
    """The store hands ``force`` and ``is_final`` to ``decide_trigger`` as facts: a stopping pipeline asked
    to stop gets no epoch from the schedule nor from a manual checkpoint, only the driver's final one."""
    running(store, "final")
    complete(store, "final")
    store.request_stop("final", "graceful")
    store.set_pipeline_state("final", PipelineState.STOPPING)
    assert store.trigger_tick("final", FAST).decision.action is TriggerAction.PIPELINE_NOT_RUNNING
    manual = store.trigger_tick("final", SLOW, force=True, triggered_by="manual")
    assert manual.decision.action is TriggerAction.PIPELINE_NOT_RUNNING and manual.started is None
    final = store.trigger_tick("final", SLOW, force=True, is_final=True, triggered_by="final-epoch")
    assert final.decision.action is TriggerAction.START and final.started is not None
    assert final.started.is_final and final.pipeline_state is PipelineState.STOPPING


def test_no_epoch_starts_while_the_cleanup_lease_is_live(store: EpochStore) -> None:
    running(store, "leased")
    run = store.acquire_cleanup_lock("leased", "cleaner", ttl=60)
    for force in (False, True):
        tick = store.trigger_tick("leased", SLOW, force=force)
        assert tick.decision.action is TriggerAction.WAIT_CLEANUP and tick.started is None
    store.release_cleanup_lock("leased", run.id)
    assert store.trigger_tick("leased", SLOW).started is not None


# ============================================================================= runs


def test_registering_a_live_pipeline_again_is_refused_unless_taking_over(store: EpochStore) -> None:
    running(store, "reg", run_id="r1")
    epoch = start(store, "reg")
    with pytest.raises(ConcurrencyConflict, match="already registered"):
        store.register_pipeline("reg", stages=["src"], run_id="r1")
    with pytest.raises(ConcurrencyConflict, match="takeover=True"):
        store.register_pipeline("reg", stages=["src"], run_id="r2")
    assert store.get_pipeline("reg").run_id == "r1"
    assert store.get_epoch("reg", epoch).state is EpochState.TRIGGERED

    taken = store.register_pipeline("reg", stages=["src", "new"], run_id="r2", takeover=True)
    assert (taken.state, taken.run_id, taken.stages) == (PipelineState.REGISTERED, "r2", ["src", "new"])
    old = store.get_epoch("reg", epoch)
    assert old.state is EpochState.FAILED and "superseded" in (old.failure_reason or "")

    store.set_pipeline_state("reg", PipelineState.STOPPED)
    again = store.register_pipeline("reg", stages=["src"], run_id="r3")  # an ended pipeline starts a new run
    assert (again.state, again.run_id) == (PipelineState.REGISTERED, "r3")


def test_restoring_an_older_epoch_supersedes_the_completed_epochs_after_it(store: EpochStore,
                                                                          migrated_dsn: str) -> None:
    """The restore cuts the channels right after barrier N: later completed epochs cannot be restored
    again, so 'latest completed' (restore, retention) must mean N until the new run completes one. That
    happens at the restore's commit point (commit_restore), never at registration: a restore that fails
    after registering changes no epoch."""
    running(store, "older", run_id="r1")
    e1, e2, e3 = complete(store, "older"), complete(store, "older"), complete(store, "older")
    e4 = expire(store, "older")
    store.set_pipeline_state("older", PipelineState.STOPPED)
    before = {e.epoch: e.state for e in store.list_epochs("older")}
    registered = store.register_pipeline("older", stages=["src", "sink"], run_id="r2")
    assert registered.restored_from_epoch is None
    assert {e.epoch: e.state for e in store.list_epochs("older")} == before  # registering changes no epoch
    # only the current, registered run commits a restore, and only of an epoch still completed
    with pytest.raises(ConcurrencyConflict, match="current run is 'r2'"):
        store.commit_restore("older", "r1", e1)
    with pytest.raises(ConfigurationError, match=f"epoch {e4} .* is expired, no longer completed"):
        store.commit_restore("older", "r2", e4)
    assert {e.epoch: e.state for e in store.list_epochs("older")} == before
    assert store.get_pipeline("older").restored_from_epoch is None
    committed = store.commit_restore("older", "r2", e1)
    assert committed.restored_from_epoch == e1 and committed.state is PipelineState.REGISTERED
    states = {e.epoch: e.state for e in store.list_epochs("older")}
    assert states == {e1: EpochState.COMPLETED, e2: EpochState.SUPERSEDED, e3: EpochState.SUPERSEDED,
                      e4: EpochState.EXPIRED}
    assert "run r2 restored the older epoch" in (store.get_epoch("older", e3).failure_reason or "")
    assert store.commit_restore("older", "r2", e1).restored_from_epoch == e1  # idempotent (a resumed restore)
    assert {e.epoch: e.state for e in store.list_epochs("older")} == states
    latest = store.latest_completed_epoch("older")
    assert latest is not None and latest.epoch == e1
    store.set_pipeline_state("older", PipelineState.RUNNING)
    e5 = complete(store, "older")  # the new run's epochs go on with higher numbers
    latest = store.latest_completed_epoch("older")
    assert e5 > e4 and latest is not None and latest.epoch == e5
    # superseded epochs are pruned like any ended epoch; the history checker accepts the transition
    plan_run = store.acquire_cleanup_lock("older", "test", ttl=60, policy={"keep_last": 1})
    plan = store.begin_prune("older", plan_run.id, [e2, e3])
    assert plan.epochs == [e2, e3]
    check_history(migrated_dsn, ["older"]).assert_clean()


# ============================================================================= the cleanup lease


def test_cleanup_lease_is_exclusive_expires_and_is_taken_over(store: EpochStore) -> None:
    running(store, "lease")
    old_epoch = complete(store, "lease")
    complete(store, "lease")
    a = store.acquire_cleanup_lock("lease", "A", ttl=60, policy={"keep_last": 1})
    with pytest.raises(CleanupLockHeld, match="held by 'A'") as held:
        store.acquire_cleanup_lock("lease", "B", ttl=60)
    assert held.value.holder == "A"
    renewed = store.renew_cleanup_lock("lease", a.id, ttl=120)
    lease = store.cleanup_lock("lease")
    assert lease is not None and lease.expires_at == renewed and lease.cleanup_run == a.id
    store.renew_cleanup_lock("lease", a.id, ttl=0.2)  # A stalls: its lease runs out

    wait_for(lambda: store.cleanup_lock("lease") is None, what="A's lease to expire")
    with pytest.raises(LockLostError):
        store.renew_cleanup_lock("lease", a.id)
    b = store.acquire_cleanup_lock("lease", "B", ttl=60)
    runs = {r.id: r for r in store.list_cleanup_runs("lease")}
    assert runs[a.id].state == "lock_lost" and f"run {b.id}" in (runs[a.id].error or "")
    for lost in (lambda: store.renew_cleanup_lock("lease", a.id),
                 lambda: store.begin_prune("lease", a.id, [old_epoch]),
                 lambda: store.finish_prune("lease", a.id, {old_epoch: 0})):
        with pytest.raises(LockLostError, match=f"run {a.id}"):
            lost()
    assert store.get_epoch("lease", old_epoch).state is EpochState.COMPLETED
    store.release_cleanup_lock("lease", a.id, state="lock_lost")  # A closing up must not drop B's lease
    lease = store.cleanup_lock("lease")
    assert lease is not None and lease.cleanup_run == b.id
    assert store.begin_prune("lease", b.id, [old_epoch]).epochs == [old_epoch]
    assert store.release_cleanup_lock("lease", b.id).state == "succeeded"
    assert store.cleanup_lock("lease") is None


# ============================================================================= errors


ERROR_CODES_TRANSIENT = ["40001", "40P01", "55P03", "57P01", "57P02", "57P03", "53300", "08006"]
ERROR_CODES_PERMANENT = ["23505", "23514", "42P01", "22P02", "42601", "28P01", "XX000"]


@pytest.mark.parametrize(("code", "transient"),
                         [(c, True) for c in ERROR_CODES_TRANSIENT] + [(c, False) for c in ERROR_CODES_PERMANENT])
def test_is_transient_classifies_real_server_errors(shared_dsn: str, code: str, transient: bool) -> None:
    conn = psycopg2.connect(shared_dsn)
    try:
        with conn.cursor() as cur, pytest.raises(psycopg2.Error) as raised:
            cur.execute(f"DO $$ BEGIN RAISE EXCEPTION 'test' USING ERRCODE = '{code}'; END $$")
    finally:
        conn.close()
    assert raised.value.pgcode == code
    assert is_transient(raised.value) is transient


def test_is_transient_classifies_connection_failures(pg_server: ThrowawayPostgres) -> None:
    def failure(dsn: str) -> psycopg2.Error:
        with pytest.raises(psycopg2.Error) as raised:
            psycopg2.connect(dsn, connect_timeout=5)
        return raised.value

    base = f"postgresql://{pg_server.user}@127.0.0.1"
    with socket_without_server() as port:
        assert is_transient(failure(f"{base}:{port}/x"))  # refused: the server may be restarting
    assert not is_transient(failure(f"{base}:{pg_server.port}/no_such_database"))
    assert not is_transient(failure(f"postgresql://nobody@127.0.0.1:{pg_server.port}/{pg_server.database}"))
    closed = psycopg2.connect(pg_server.dsn)
    closed.close()
    with pytest.raises(psycopg2.InterfaceError) as raised:
        closed.cursor()
    assert is_transient(raised.value)
    assert is_transient(ConnectionResetError())
    assert not is_transient(ValueError("x"))


class socket_without_server:
    """A local port nobody listens on (bound, not listening, so no one else takes it meanwhile)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_permanent_errors_are_raised_at_once_as_store_errors(pg_server: ThrowawayPostgres, store: EpochStore,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="airflow_arroyo.store._retry")
    for dsn in (f"postgresql://{pg_server.user}@127.0.0.1:{pg_server.port}/no_such_database",
                f"postgresql://nobody@127.0.0.1:{pg_server.port}/{pg_server.database}"):
        bad = EpochStore(dsn)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="does not exist") as raised:
            bad.migrate()
        assert not isinstance(raised.value, TransientStoreError)
        assert time.monotonic() - t0 < 5
        bad.close()
    # a constraint violation: permanent too
    running(store, "perm", stages=["a"])
    epoch = start(store, "perm")
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="23514") as raised:
        store.ack_epoch("perm", epoch, "a", alignment_ms=-1)
    assert not isinstance(raised.value, TransientStoreError)
    assert time.monotonic() - t0 < 5
    assert store.get_epoch("perm", epoch).state is EpochState.TRIGGERED
    assert [r for r in caplog.records if "transient" in r.getMessage()] == []


def test_the_store_reconnects_after_a_server_restart(private_pg: ThrowawayPostgres,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="airflow_arroyo.store._retry")
    store = EpochStore(private_pg.dsn, retry_seconds=60)
    try:
        store.migrate()
        running(store, "restart", stages=["s"])
        first = start(store, "restart")  # the pool now holds connections the restart will cut
        private_pg.restart()
        store.ack_epoch("restart", first, "s")  # on a dead pooled connection first, then a new one
        assert store.get_epoch("restart", first).state is EpochState.COMPLETED

        # mid-call: the server is down when the call starts and comes back while it retries
        private_pg.stop()
        caplog.clear()
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(store.trigger_tick, "restart", SLOW, force=True)
            wait_for(lambda: any("transient error" in r.getMessage() for r in caplog.records),
                       what="the call to retry while the server is down")
            assert not call.done()
            private_pg.start()
            tick = call.result(timeout=60)
        assert tick.started is not None and tick.started.epoch == first + 1
        assert [e.epoch for e in store.list_epochs("restart")] == [first + 1, first]  # started once
    finally:
        store.close()
    check_history(private_pg.dsn).assert_clean()


def test_after_a_restart_a_full_pool_reconnects_at_once(private_pg: ThrowawayPostgres,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A restart kills every pooled connection: finding one dead must not cost one retry (and its
    back-off) per idle connection before a fresh one is made."""
    caplog.set_level(logging.WARNING, logger="airflow_arroyo.store._retry")
    store = EpochStore(private_pg.dsn, max_connections=8)
    try:
        store.migrate()
        barrier = threading.Barrier(8)

        def hold_a_connection() -> None:  # 8 calls at once: the pool ends with 8 idle connections
            store._tx(lambda cur: (barrier.wait(timeout=30), cur.execute("SELECT 1")))

        with ThreadPoolExecutor(8) as pool:
            for f in [pool.submit(hold_a_connection) for _ in range(8)]:
                f.result(timeout=60)
        assert len(store_backends(private_pg.dsn, "airflow-arroyo")) == 8
        private_pg.restart()
        caplog.clear()
        t0 = time.monotonic()
        store.db_now()
        elapsed = time.monotonic() - t0
        retries = [r for r in caplog.records if "transient error" in r.getMessage()]
        assert len(retries) <= 1, [r.getMessage() for r in retries]
        assert elapsed < 3, elapsed
    finally:
        store.close()


def test_retries_are_bounded_then_raise_a_transient_store_error(private_pg: ThrowawayPostgres) -> None:
    store = EpochStore(private_pg.dsn, retry_seconds=1.0)
    try:
        store.migrate()
        private_pg.stop()
        t0 = time.monotonic()
        with pytest.raises(TransientStoreError, match="unreachable after retrying") as raised:
            store.db_now()
        elapsed = time.monotonic() - t0
        assert 0.5 < elapsed < 10
        assert "password" not in str(raised.value)
    finally:
        store.close()


STORE_CALLS: dict[str, Callable[[EpochStore], object]] = {
    "get_pipeline": lambda s: s.get_pipeline("ghost"),
    "set_pipeline_state": lambda s: s.set_pipeline_state("ghost", PipelineState.RUNNING),
    "heartbeat": lambda s: s.heartbeat("ghost", "r"),
    "request_stop": lambda s: s.request_stop("ghost"),
    "trigger_tick": lambda s: s.trigger_tick("ghost", SLOW),
    "get_epoch": lambda s: s.get_epoch("ghost", 1),
    "list_epochs": lambda s: s.list_epochs("ghost"),
    "unpruned_epochs": lambda s: s.unpruned_epochs("ghost"),
    "ack_epoch": lambda s: s.ack_epoch("ghost", 1, "s"),
    "fail_epoch": lambda s: s.fail_epoch("ghost", 1, "x"),
    "acquire_cleanup_lock": lambda s: s.acquire_cleanup_lock("ghost", "h"),
    "renew_cleanup_lock": lambda s: s.renew_cleanup_lock("ghost", 1),
    "release_cleanup_lock": lambda s: s.release_cleanup_lock("ghost", 1),
    "begin_prune": lambda s: s.begin_prune("ghost", 1, [1]),
    "finish_prune": lambda s: s.finish_prune("ghost", 1, {1: 0}),
}


@pytest.mark.parametrize("call", list(STORE_CALLS))
def test_unknown_pipelines_raise_unknown_pipeline_error(shared: EpochStore, call: str) -> None:
    with pytest.raises(UnknownPipelineError, match="'ghost'"):
        STORE_CALLS[call](shared)


# name -> (needs a running pipeline p whose cleanup run ``run`` holds the lease, the call)
BAD_INPUT: dict[str, tuple[bool, Callable[[EpochStore, str, int], object]]] = {
    "empty pipeline id": (False, lambda s, p, run: s.register_pipeline("", stages=["s"], run_id="r")),
    "slash in pipeline id": (False, lambda s, p, run: s.register_pipeline("a/b", stages=["s"], run_id="r")),
    "dot-dot pipeline id": (False, lambda s, p, run: s.register_pipeline("..", stages=["s"], run_id="r")),
    "long pipeline id": (False, lambda s, p, run: s.register_pipeline("x" * 201, stages=["s"], run_id="r")),
    "non-ASCII pipeline id": (False, lambda s, p, run: s.register_pipeline("héllo", stages=["s"], run_id="r")),
    "pipeline id not a string": (False, lambda s, p, run: s.register_pipeline(5, stages=["s"], run_id="r")),  # type: ignore[arg-type]
    "no stages": (False, lambda s, p, run: s.register_pipeline(p, stages=[], run_id="r")),
    "zero interval": (False, lambda s, p, run: s.register_pipeline(p, stages=["s"], run_id="r",
                                                                   checkpoint_interval=0)),
    "NaN interval": (False, lambda s, p, run: s.register_pipeline(p, stages=["s"], run_id="r",
                                                                  checkpoint_interval=math.nan)),
    "infinite interval": (False, lambda s, p, run: s.register_pipeline(p, stages=["s"], run_id="r",
                                                                       checkpoint_interval=math.inf)),
    "stop mode": (True, lambda s, p, run: s.request_stop(p, "later")),
    "zero lease": (True, lambda s, p, run: s.acquire_cleanup_lock(p, "h2", ttl=0)),
    "NaN lease": (True, lambda s, p, run: s.acquire_cleanup_lock(p, "h2", ttl=math.nan)),
    "negative renewal": (True, lambda s, p, run: s.renew_cleanup_lock(p, run, ttl=-1)),
    "NaN renewal": (True, lambda s, p, run: s.renew_cleanup_lock(p, run, ttl=math.nan)),
    "cleanup end state": (True, lambda s, p, run: s.release_cleanup_lock(p, run, state="done")),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_before_anything_is_written(shared: EpochStore, shared_dsn: str, case: str) -> None:
    needs_pipeline, call = BAD_INPUT[case]
    pid, run = new_id("bad"), 0
    if needs_pipeline:
        running(shared, pid)
        run = shared.acquire_cleanup_lock(pid, "h", ttl=60).id
    tables = ("arroyo_pipelines", "arroyo_epochs", "arroyo_history", "arroyo_cleanup_runs", "arroyo_cleanup_locks")
    before = {t: count(shared_dsn, t) for t in tables}
    lease = shared.cleanup_lock(pid) if needs_pipeline else None
    with pytest.raises(ConfigurationError):
        call(shared, pid, run)
    assert {t: count(shared_dsn, t) for t in tables} == before
    if needs_pipeline:
        assert shared.cleanup_lock(pid) == lease


def test_an_empty_dsn_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="DSN is required"):
        EpochStore("")


# ============================================================================= connections


def store_backends(dsn: str, application_name: str) -> set[int]:
    return {int(r[0]) for r in sql(dsn, "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
                                   (application_name,))}


def test_the_pool_keeps_and_reuses_its_connections(pg_dsn: str) -> None:
    """One connection per call would cost a server process fork per tick (hundreds of triggers share
    a store): sequential calls must reuse one pooled connection."""
    store = EpochStore(pg_dsn, application_name="arroyo-pool-test")
    try:
        store.migrate()
        store.db_now()
        first = store_backends(pg_dsn, "arroyo-pool-test")
        for _ in range(5):
            store.db_now()
        assert len(first) == 1
        assert store_backends(pg_dsn, "arroyo-pool-test") == first
    finally:
        store.close()
    wait_for(lambda: not store_backends(pg_dsn, "arroyo-pool-test"), what="close() to end the connections")


def test_concurrent_calls_from_threads_share_the_pool(store: EpochStore) -> None:
    running(store, "threads", stages=["s"])
    epochs = [complete(store, "threads") for _ in range(3)]
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(20):
                assert {e.epoch for e in store.list_epochs("threads")} == set(epochs)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(12)]  # more threads than connections
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []


def test_a_refused_connection_logs_one_warning_and_its_later_retries_at_debug(
        pg_server: ThrowawayPostgres, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 30, finding 5 d: one line a failure at the default level, however many retries it takes."""
    caplog.set_level(logging.DEBUG, logger="airflow_arroyo.store._retry")
    with socket_without_server() as port:
        store = EpochStore(f"postgresql://{pg_server.user}@127.0.0.1:{port}/x", retry_seconds=1.5)
        try:
            with pytest.raises(TransientStoreError, match="unreachable after retrying"):
                store.db_now()
        finally:
            store.close()
    retries = [r for r in caplog.records if r.name == "airflow_arroyo.store._retry"]
    assert [r.levelno for r in retries][:1] == [logging.WARNING] and len(retries) > 2
    assert all(r.levelno == logging.DEBUG for r in retries[1:])
    assert "OperationalError" in retries[0].getMessage() and "attempt 1" in retries[0].getMessage()


def test_a_store_error_without_a_sqlstate_or_a_message_still_says_what_it_is() -> None:
    """Issue 30, finding 5 c: no "epoch store error :" (a missing SQLSTATE) and never an empty text."""
    from airflow_arroyo.store._retry import call_with_retry

    def fails() -> None:
        raise psycopg2.ProgrammingError()

    with pytest.raises(StoreError) as raised:
        call_with_retry(fails)
    assert str(raised.value) == "epoch store error: ProgrammingError (no message)"
