"""Many pipelines' ticks in one transaction (``EpochStore.trigger_ticks``), against a real PostgreSQL.

Each pipeline of a batch must be decided exactly as alone: the cases below cover every decision in
one batch, with hand-written expectations. Then the safety proof of batching: the rows another
transaction holds are skipped (and waited for when asked to), and two triggerers' batches racing over
the same pipelines never put two epochs in flight, never deadlock, and leave a clean history.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import psycopg2
import psycopg2.extensions
import psycopg2.extras
import pytest

from airflow_arroyo.core.epochs import (
    CheckpointPolicy,
    PipelineState,
    TriggerAction,
    schedule_phase,
    schedule_point_after,
)
from airflow_arroyo.core.exceptions import ConfigurationError, UnknownPipelineError
from airflow_arroyo.devtools.history import check_history
from airflow_arroyo.store import EpochStore, TickRequest, TickResult, ticks
from airflow_arroyo.store._db import Database
from airflow_arroyo.store._prepared import Prepared, execute_prepared
from airflow_arroyo.testing import wait_for
from tests.support import running

POLICY = CheckpointPolicy(interval=3600, timeout=7200, tolerable_failures=3)
STAGES = ["source", "sink"]


@pytest.fixture(autouse=True, params=[True, False], ids=["one-call", "separate"])
def lock_facts_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Every test on both ways a batch reads its locks and facts: one call of ``arroyo_tick_lock_facts``
    (migration 0016) and the separate statements before it (``ticks.ONE_CALL = False``, the benchmark's
    baseline): they must decide alike."""
    monkeypatch.setattr(ticks, "ONE_CALL", request.param)
    return bool(request.param)


def shift_history(dsn: str, pid: str, seconds: float) -> None:
    """Move the pipeline's epochs ``seconds`` into the past (time passes for it alone)."""
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("UPDATE arroyo_epochs SET triggered_at = triggered_at - %(d)s, timeout_at = timeout_at - %(d)s,"
                        " ended_at = ended_at - %(d)s WHERE pipeline_id = %(p)s",
                        {"d": timedelta(seconds=seconds), "p": pid})
    finally:
        conn.close()


def test_a_batch_decides_each_pipeline_as_it_would_be_decided_alone(store: EpochStore, migrated_dsn: str) -> None:
    running(store, "due", "in-flight", "timed-out", "not-due", "leased", "watched", stages=STAGES)
    store.register_pipeline("registered", stages=STAGES, run_id="r1")
    running(store, "stopped", stages=STAGES)
    store.set_pipeline_state("stopped", PipelineState.STOPPED)
    # in-flight: an epoch in flight, not timed out
    store.trigger_tick("in-flight", POLICY)
    # timed-out: two failed epochs, then one in flight past its timeout
    for _ in range(2):
        started = store.trigger_tick("timed-out", POLICY, force=True).started
        assert started is not None
        store.fail_epoch("timed-out", started.epoch, "stage sink could not snapshot")
    store.trigger_tick("timed-out", POLICY, force=True)
    shift_history(migrated_dsn, "timed-out", 7300)
    # not-due: one completed epoch, started up to a minute ago, after the point of the schedule before the next
    done = store.trigger_tick("not-due", POLICY).started
    assert done is not None
    for stage in STAGES:
        store.ack_epoch("not-due", done.epoch, stage)
    not_due_at = schedule_point_after(done.triggered_at, POLICY.interval, schedule_phase("not-due", POLICY.interval))
    since_point = POLICY.interval - (not_due_at - done.triggered_at).total_seconds()  # since the point before
    shift_history(migrated_dsn, "not-due", max(0.0, min(60.0, since_point - 1)))  # the next point stays not_due_at
    # leased: a cleanup holds the lock
    store.acquire_cleanup_lock("leased", "retention@w1", ttl=600)
    # watched: epoch 1 completed since the caller saw it in flight; epoch 2 in flight now
    first = store.trigger_tick("watched", POLICY).started
    assert first is not None
    for stage in STAGES:
        store.ack_epoch("watched", first.epoch, stage, bytes_new=5)
    store.trigger_tick("watched", POLICY, force=True)

    order = ["due", "in-flight", "timed-out", "not-due", "leased", "registered", "stopped", "watched", "missing"]
    results = store.trigger_ticks([TickRequest(pid, POLICY, triggered_by="batch", watch=(1,) if pid == "watched"
                                               else ()) for pid in order])
    by_pid = dict(zip(order, results, strict=True))

    assert isinstance(by_pid["missing"], UnknownPipelineError)
    decided = {pid: r for pid, r in by_pid.items() if isinstance(r, TickResult)}
    assert {pid: r.decision.action for pid, r in decided.items()} == {
        "due": TriggerAction.START,
        "in-flight": TriggerAction.WAIT_IN_FLIGHT,
        "timed-out": TriggerAction.EXPIRE,
        "not-due": TriggerAction.WAIT_SCHEDULE,
        "leased": TriggerAction.WAIT_CLEANUP,
        "registered": TriggerAction.PIPELINE_NOT_RUNNING,
        "stopped": TriggerAction.PIPELINE_ENDED,
        "watched": TriggerAction.WAIT_IN_FLIGHT,
    }
    due = decided["due"]
    assert due.started is not None and due.started.epoch == 1 and due.started.triggered_by == "batch"
    assert due.started.stages == STAGES and due.started.run_id == "r1"
    assert store.get_pipeline("due").last_epoch == 1
    assert due.consecutive_failures == 0
    timed_out = decided["timed-out"]
    assert timed_out.expired is not None and timed_out.expired.epoch == 3
    assert timed_out.consecutive_failures == 3  # two failed and the one expired now
    assert store.get_epoch("timed-out", 3).failure_reason == "not acknowledged by every stage within 7200s"
    not_due = decided["not-due"]
    assert not_due.decision.recheck_at is not None
    assert not_due.decision.recheck_at == not_due_at
    assert [e.epoch for e in decided["watched"].ended] == [1]
    assert decided["watched"].ended[0].bytes_new == 10 and decided["watched"].ended[0].state.value == "completed"
    assert all(r.observed_at is not None for r in decided.values())
    # one statement read every pipeline's facts (each row at its own clock_timestamp())
    nows = sorted(r.now for r in decided.values())
    assert (nows[-1] - nows[0]).total_seconds() < 1.0
    check_history(migrated_dsn).assert_clean()


def test_a_pipeline_appears_once_per_batch(store: EpochStore) -> None:
    running(store, "p", stages=STAGES)
    with pytest.raises(ConfigurationError, match="once per batch"):
        store.trigger_ticks([TickRequest("p", POLICY), TickRequest("p", POLICY)])
    assert store.trigger_ticks([]) == []


def test_a_row_another_transaction_holds_is_skipped_not_waited_for(store: EpochStore, migrated_dsn: str) -> None:
    running(store, "busy", "free", stages=STAGES)
    holder = psycopg2.connect(migrated_dsn)
    try:
        with holder.cursor() as cur:  # e.g. a cleanup in the middle of its transaction
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = 'busy' FOR UPDATE")
        busy, free = store.trigger_ticks([TickRequest("busy", POLICY, skip_if_locked=True),
                                          TickRequest("free", POLICY, skip_if_locked=True)])
        assert busy is None
        assert isinstance(free, TickResult) and free.started is not None
        # asked again without skipping, the tick waits for the lock and then decides
        waited: list[object] = []
        thread = threading.Thread(target=lambda: waited.extend(store.trigger_ticks([TickRequest("busy", POLICY)])))
        thread.start()
        thread.join(0.3)
        assert thread.is_alive(), "the tick did not wait for the row lock"
        holder.rollback()
        thread.join(10)
        (result,) = waited
        assert isinstance(result, TickResult) and result.started is not None
    finally:
        holder.close()


def test_two_triggerers_batches_racing_over_the_same_pipelines(store: EpochStore, migrated_dsn: str) -> None:
    """Triggerer HA at the store: two batches at a time over the same pipelines (in different orders,
    with and without skipping locked rows), many rounds: one of them starts each epoch, no deadlock,
    and the database's history is clean."""
    pids = [f"p{i:02d}" for i in range(40)]
    running(store, *pids, stages=STAGES)
    policy = CheckpointPolicy(interval=0.001, timeout=60)
    other = EpochStore(migrated_dsn)
    starts: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def triggerer(s: EpochStore, order: list[str], skip: bool) -> None:
        try:
            for _ in range(15):
                results = s.trigger_ticks([TickRequest(p, policy, skip_if_locked=skip) for p in order])
                with lock:
                    starts.append(sum(isinstance(r, TickResult) and r.started is not None for r in results))
                # the fake pipelines: complete whatever is in flight, under each pipeline's lock
                for p in order[::7]:
                    ep = s.in_flight_epoch(p)
                    if ep is not None:
                        for stage in STAGES:
                            s.ack_epoch(p, ep.epoch, stage)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    try:
        threads = [threading.Thread(target=triggerer, args=(store, pids, False)),
                   threading.Thread(target=triggerer, args=(other, pids[::-1], True))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        other.close()
    assert errors == []
    report = check_history(migrated_dsn, pids)
    report.assert_clean()
    assert report.counts["triggered"] == sum(starts) > len(pids)


def test_a_pipeline_whose_driver_stopped_heartbeating_gets_no_epoch_alone_or_in_a_batch(store: EpochStore) -> None:
    """A running pipeline whose heartbeat is older than the policy's bound is not alive: epochs started for it
    would only expire one after another. Batched with a live pipeline, each is decided on its own heartbeat."""
    running(store, "silent", "alive")
    conn = psycopg2.connect(store.dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp() - interval '45 seconds'"
                        " WHERE pipeline_id = 'silent'")
    finally:
        conn.close()
    policy = CheckpointPolicy(interval=3600, timeout=7200, heartbeat_timeout=30)
    silent, alive = store.trigger_ticks([TickRequest("silent", policy), TickRequest("alive", policy)])
    assert isinstance(silent, TickResult) and isinstance(alive, TickResult)
    assert silent.decision.action is TriggerAction.PIPELINE_NOT_ALIVE and silent.started is None
    assert "heartbeat is 45s old" in silent.decision.reason
    assert alive.started is not None
    # not even forced (a manual checkpoint): the epoch could only expire
    assert store.trigger_tick("silent", policy, force=True).started is None
    store.heartbeat("silent", "r1")
    assert store.trigger_tick("silent", policy).started is not None
    assert [e.state.value for e in store.list_epochs("silent")] == ["triggered"]


def test_a_statement_is_prepared_once_per_connection_and_outlives_a_rollback(migrated_dsn: str) -> None:
    statement = Prepared("arroyo_test_double", ("int[]",), "SELECT x * 2 AS y FROM unnest($1) AS x ORDER BY x")

    def prepared_here(conn: Any) -> list[str]:
        with conn.cursor() as cur:
            cur.execute("SELECT statement FROM pg_prepared_statements WHERE name = %s", (statement.name,))
            return [row[0] for row in cur.fetchall()]

    first, second = psycopg2.connect(migrated_dsn), psycopg2.connect(migrated_dsn)
    try:
        with first.cursor() as cur:
            execute_prepared(cur, statement, ([3, 1, 2],))
            assert cur.fetchall() == [(2,), (4,), (6,)]
        first.rollback()  # a failed batch rolls back: the statement stays prepared in the session
        with first.cursor() as cur:
            execute_prepared(cur, statement, ([5],))
            assert cur.fetchall() == [(10,)]
        assert len(prepared_here(first)) == 1
        assert prepared_here(second) == []  # a new connection (the pool replaced a broken one) prepares again
        with second.cursor() as cur:
            execute_prepared(cur, statement, ([],))
            assert cur.fetchall() == []
        assert len(prepared_here(second)) == 1
        with pytest.raises(ValueError, match="1 parameters expected"):
            execute_prepared(second.cursor(), statement, ())
    finally:
        first.close()
        second.close()


def test_a_tick_that_waited_for_a_lock_decides_on_what_the_holder_committed(store: EpochStore,
                                                                          migrated_dsn: str) -> None:
    """The facts are read after the lock is held (a fresh snapshot, in the one call as in separate statements):
    a cleanup that took its lease while the tick waited for the row is seen, so no epoch starts during it."""
    running(store, "p", stages=STAGES)
    holder = psycopg2.connect(migrated_dsn)
    try:
        with holder.cursor() as cur:  # a cleanup in the middle of taking its lease under the row lock
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = 'p' FOR UPDATE")
            cur.execute("INSERT INTO arroyo_cleanup_locks (pipeline_id, cleanup_run, holder, expires_at)"
                        " VALUES ('p', 1, 'retention@w1', clock_timestamp() + interval '10 minutes')")
        waited: list[object] = []
        thread = threading.Thread(target=lambda: waited.extend(store.trigger_ticks([TickRequest("p", POLICY)])))
        thread.start()
        watcher = psycopg2.connect(migrated_dsn)
        try:
            with watcher.cursor() as cur:
                def tick_waits_for_the_lock() -> bool:
                    cur.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                " AND pid <> pg_backend_pid() AND datname = current_database()")
                    return bool(cur.fetchone()[0])  # type: ignore[index]
                wait_for(tick_waits_for_the_lock, what="the tick waiting for the row lock")
        finally:
            watcher.close()
        holder.commit()
        thread.join(10)
        (result,) = waited
        assert isinstance(result, TickResult)
        assert result.decision.action is TriggerAction.WAIT_CLEANUP and result.started is None
    finally:
        holder.close()
    assert store.list_epochs("p") == []


def test_a_steady_batch_is_three_round_trips(migrated_dsn: str, lock_facts_path: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """What each tick of a busy triggerer pays for is its batch's round trips: a batch that finds an epoch
    ended, one skipped row and one unknown pipeline, and starts epochs, is three in one call (BEGIN with the
    locks, existence, facts and ended epochs; the starts; COMMIT), seven as separate statements."""
    sent: list[str] = []

    def begins(cur: Any) -> None:  # psycopg2 sends BEGIN alone before a transaction's first statement
        if not cur.connection.autocommit and cur.connection.status == psycopg2.extensions.STATUS_READY:
            sent.append("BEGIN")

    class Counting(psycopg2.extensions.cursor):
        def execute(self, query: Any, vars: Any = None) -> None:
            begins(self)
            sent.append(str(query))
            super().execute(query, vars)

    class CountingDict(psycopg2.extras.RealDictCursor):
        def execute(self, query: Any, vars: Any = None) -> None:
            begins(self)
            sent.append(str(query))
            super().execute(query, vars)

    class Connection(psycopg2.extensions.connection):
        def commit(self) -> None:
            if self.status != psycopg2.extensions.STATUS_READY:
                sent.append("COMMIT")
            super().commit()

        def cursor(self, *args: Any, **kwargs: Any) -> Any:
            factory = kwargs.pop("cursor_factory", None)
            dict_rows = factory is not None and issubclass(factory, psycopg2.extras.RealDictCursor)
            return super().cursor(*args, cursor_factory=CountingDict if dict_rows else Counting, **kwargs)

    def connect(db: Database) -> Any:  # the store's connections, counting what their cursors send
        return psycopg2.connect(db.dsn, connection_factory=Connection, application_name=db.application_name)

    monkeypatch.setattr(Database, "connect", connect)
    s = EpochStore(migrated_dsn, max_connections=1)
    holder = psycopg2.connect(migrated_dsn)
    try:
        pids = [f"p{i}" for i in range(5)]
        running(s, *pids, stages=STAGES)
        policy = CheckpointPolicy(interval=0.001, timeout=60)
        first = s.trigger_ticks([TickRequest(p, policy) for p in pids])  # prepares the statements
        for p, r in zip(pids, first, strict=True):
            assert isinstance(r, TickResult) and r.started is not None
            for stage in STAGES:
                s.ack_epoch(p, r.started.epoch, stage)
        with holder.cursor() as cur:
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = 'p4' FOR UPDATE")
        sent.clear()
        results = s.trigger_ticks([TickRequest(p, policy, skip_if_locked=True, watch=(1,)) for p in pids]
                                  + [TickRequest("nope", policy, skip_if_locked=True)])
        statements = [q for q in sent if not q.startswith("PREPARE")]
        assert len(statements) == (3 if lock_facts_path else 7), statements
        assert results[4] is None and isinstance(results[5], UnknownPipelineError)
        for r in results[:4]:
            assert isinstance(r, TickResult) and r.started is not None and r.started.epoch == 2
            assert [(e.epoch, e.state.value) for e in r.ended] == [(1, "completed")]
            assert r.ended[0].ended_at is not None and r.ended[0].ended_at.tzinfo is not None
    finally:
        holder.close()
        s.close()
    check_history(migrated_dsn).assert_clean()
