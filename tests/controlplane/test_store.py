"""The epoch store's own behaviour, against a real PostgreSQL started by the suite."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import psycopg2
import pytest

from airflow_arroyo.epochs import CheckpointPolicy, EpochState, PipelineState, TriggerAction
from airflow_arroyo.store import EpochStore

# ----------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], object], *, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def running(store: EpochStore, pipeline_id: str, stages: Sequence[str] = ("src", "sink"), run_id: str = "r1") -> None:
    store.register_pipeline(pipeline_id, stages=list(stages), run_id=run_id)
    store.set_pipeline_state(pipeline_id, PipelineState.RUNNING)


def lock_waiters(dsn: str) -> int:
    """Backends of this database waiting for a lock right now."""
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                        " AND wait_event_type = 'Lock'")
            row = cur.fetchone()
            return int(row[0]) if row else 0
    finally:
        conn.close()


FAST = CheckpointPolicy(interval=0.05, timeout=0.05)


# ----------------------------------------------------------------------------- races


def test_ack_racing_the_expiry_of_the_same_epoch_is_serialised(store: EpochStore, pg_dsn: str) -> None:
    """A stage's last ack and the trigger's expiry of the same epoch arrive together: one of them wins,
    neither errors, and the history stays in commit order (every writer takes the pipeline lock)."""
    running(store, "race", stages=["s"])
    started = store.trigger_tick("race", FAST).started
    assert started is not None
    wait_until(lambda: store.db_now() > started.timeout_at, what="the epoch to pass its timeout")
    blocker = psycopg2.connect(pg_dsn)
    try:
        with blocker.cursor() as cur:  # hold the epoch row so that both writers queue behind it
            cur.execute("SELECT 1 FROM arroyo_epochs WHERE pipeline_id = 'race' AND epoch = %s FOR UPDATE",
                        (started.epoch,))
        with ThreadPoolExecutor(2) as pool:
            ack = pool.submit(store.ack_epoch, "race", started.epoch, "s")
            wait_until(lambda: lock_waiters(pg_dsn) >= 1, what="the ack to wait for a lock")
            tick = pool.submit(store.trigger_tick, "race", FAST)
            wait_until(lambda: lock_waiters(pg_dsn) >= 2, what="the tick to wait for a lock")
            blocker.commit()
            ack_state = ack.result(timeout=30)
            tick_result = tick.result(timeout=30)
    finally:
        blocker.close()
    assert ack_state is EpochState.COMPLETED
    assert store.get_epoch("race", started.epoch).state is EpochState.COMPLETED
    assert tick_result.decision.action is not TriggerAction.EXPIRE


# ----------------------------------------------------------------------------- connections


def store_backends(dsn: str, application_name: str) -> set[int]:
    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pid FROM pg_stat_activity WHERE application_name = %s", (application_name,))
            return {int(r[0]) for r in cur.fetchall()}
    finally:
        conn.close()


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
    wait_until(lambda: not store_backends(pg_dsn, "arroyo-pool-test"), what="close() to end the connections")
