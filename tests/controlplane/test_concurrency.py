"""The control plane's concurrency proof, checked from the database's own history.

* The checker (:mod:`airflow_arroyo.devtools.history`) is first shown to fail: synthetic histories
  written straight into ``arroyo_history`` of a scratch database, each with one kind of breach, must
  be reported as exactly that breach (and the unbroken history as clean); real breaches made with raw
  SQL behind the store's back, recorded by the database's own triggers, must be reported too.
* Then many processes (`tests/controlplane/chaos.py`) trigger, clean up and acknowledge the
  same pipelines for 20 seconds, and the history must hold no breach at all; and again while
  PostgreSQL restarts twice, after which epochs must keep being triggered and completed.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg2
import psycopg2.extras
import pytest

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, RetentionPolicy
from airflow_arroyo.core.retention import prune_pipeline
from airflow_arroyo.devtools.history import HistoryReport, ViolationKind, check_history
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import wait_for
from tests.controlplane.chaos import ChaosConfig, ChaosResult, missing_objects, prepare_pipelines, run_chaos
from tests.support import sql

V = ViolationKind

# The real CheckpointTrigger in the trigger processes (its core, trigger_tick, with "store").
TRIGGER_MODE = "airflow"
# forkserver: one server process imports Airflow once and forks the workers from that clean,
# single-threaded process; with spawn each of the 8 trigger processes imports Airflow itself
# (about 6 s of CPU each on this 2-core machine).
START_METHOD = "forkserver"


# ============================================================================= synthetic histories

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclasses.dataclass(frozen=True)
class Ev:
    """One history row: ``t`` seconds after T0; rows with the same ``tx`` label share a txid."""

    t: float
    kind: str  # epoch_state | lock_acquired | lock_renewed | lock_released
    epoch: int | None = None
    old: str | None = None
    new: str | None = None
    run: int | None = None
    expires: float | None = None
    tx: str | None = None


def E(t: float, epoch: int, old: str | None, new: str, tx: str | None = None) -> Ev:
    return Ev(t, "epoch_state", epoch=epoch, old=old, new=new, tx=tx)


def L(t: float, kind: str, run: int, expires: float, tx: str | None = None) -> Ev:
    return Ev(t, f"lock_{kind}", run=run, expires=expires, tx=tx)


KEEP_2 = {"keep_last": 2, "keep_newer_than_s": None}

# A clean history: four epochs (the third expires), a cleanup run keeping the last 2 completed
# prunes epochs 1 and 3 under its lease, releases it, and epoch 5 starts.
BASE: list[Ev] = [
    E(0, 1, None, "triggered"), E(1, 1, "triggered", "completed"),
    E(2, 2, None, "triggered"), E(3, 2, "triggered", "completed"),
    E(4, 3, None, "triggered"), E(5, 3, "triggered", "expired"),
    E(6, 4, None, "triggered"), E(7, 4, "triggered", "completed"),
    L(10, "acquired", 1, expires=20), L(11, "renewed", 1, expires=21),
    E(12, 1, "completed", "pruning", tx="begin"), E(12, 3, "expired", "pruning", tx="begin"),
    E(13, 1, "pruning", "pruned", tx="finish"), E(13, 3, "pruning", "pruned", tx="finish"),
    L(14, "released", 1, expires=21),
    E(15, 5, None, "triggered"),
]


def variant(remove: Iterable[Ev] = (), add: Iterable[Ev] = (), base: Sequence[Ev] = BASE) -> list[Ev]:
    """BASE without ``remove``, with ``add``, in time order (stable: same-time rows keep their order)."""
    gone = list(remove)
    for ev in gone:
        assert ev in base, f"{ev} is not in the base history"
    return sorted([ev for ev in base if ev not in gone] + list(add), key=lambda ev: ev.t)


_histories = itertools.count(1)


def write_history(dsn: str, events: Sequence[Ev], policies: Mapping[int, Mapping[str, Any]]) -> str:
    """Write ``events`` as the history of a new pipeline (seq in list order) with its cleanup runs'
    policies; return the pipeline id. Runs, seqs and txids are offset so histories can share a database."""
    n = next(_histories)
    pipeline_id = f"synthetic-{n}"
    base = n * 10_000
    txids: dict[str, int] = {}
    fresh = itertools.count(base)
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("INSERT INTO arroyo_pipelines (pipeline_id, state, stages) VALUES (%s, 'running', '{s}')",
                        (pipeline_id,))
            for run, policy in policies.items():
                cur.execute("INSERT INTO arroyo_cleanup_runs (id, pipeline_id, holder, policy)"
                            " VALUES (%s, %s, %s, %s::jsonb)",
                            (base + run, pipeline_id, f"holder-{run}", psycopg2.extras.Json(dict(policy))))
            for seq, ev in enumerate(events, start=base):
                txid = txids.setdefault(ev.tx, next(fresh)) if ev.tx else next(fresh)
                cur.execute(
                    "INSERT INTO arroyo_history (seq, at, txid, pipeline_id, kind, epoch, old_state, new_state,"
                    " cleanup_run, holder, lock_expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
                    (seq, T0 + timedelta(seconds=ev.t), txid, pipeline_id, ev.kind, ev.epoch, ev.old, ev.new,
                     None if ev.run is None else base + ev.run, None if ev.run is None else f"holder-{ev.run}",
                     T0 + timedelta(seconds=ev.expires) if ev.expires is not None else None),
                )
    finally:
        conn.close()
    return pipeline_id


@pytest.fixture(scope="module")
def scratch_dsn(migrated_db: Callable[[str], str]) -> str:
    """One migrated database for the synthetic histories (each writes its own pipeline)."""
    return migrated_db("history")


def checked(dsn: str, events: Sequence[Ev], policies: Mapping[int, Mapping[str, Any]] | None = None) -> HistoryReport:
    pipeline_id = write_history(dsn, events, {1: KEEP_2} if policies is None else policies)
    return check_history(dsn, [pipeline_id], against_tables=False)


def test_checker_finds_nothing_wrong_in_a_clean_history(scratch_dsn: str) -> None:
    report = checked(scratch_dsn, BASE)
    assert report.violations == []
    assert report.counts["triggered"] == 5
    assert report.counts["completed"] == 3
    assert report.counts["expired"] == 1
    assert report.counts["pruning"] == report.counts["pruned"] == 2
    assert report.counts["lock_acquired"] == report.counts["lock_released"] == 1


# Each case: a history with one kind of breach, and the violation kinds it must produce.
BREACHES: dict[str, tuple[list[Ev], dict[int, dict[str, Any]] | None, set[ViolationKind]]] = {
    "second epoch triggered while one is in flight": (
        variant(remove=[E(15, 5, None, "triggered")],
                add=[E(6.5, 5, None, "triggered"), E(8, 5, "triggered", "completed")]),
        None, {V.TWO_IN_FLIGHT}),
    "epoch triggered while the cleanup lease is live": (
        variant(remove=[E(15, 5, None, "triggered")], add=[E(13.5, 5, None, "triggered")]),
        None, {V.TRIGGERED_UNDER_LOCK}),
    "epoch number reused": (
        variant(remove=[E(15, 5, None, "triggered")], add=[E(15, 2, None, "triggered")]),
        None, {V.EPOCH_NOT_INCREASING}),
    "illegal transition expired -> failed": (
        variant(remove=[E(12, 3, "expired", "pruning", tx="begin")],
                add=[E(5.5, 3, "expired", "failed"), E(12, 3, "failed", "pruning", tx="begin")]),
        None, {V.ILLEGAL_TRANSITION}),
    "change from a state the epoch was not in": (
        variant(add=[E(3.5, 2, "triggered", "completed")]),
        None, {V.STATE_MISMATCH}),
    "in-flight epoch marked pruning": (
        variant(add=[L(16, "acquired", 2, expires=30), E(17, 5, "triggered", "pruning")]),
        {1: KEEP_2, 2: KEEP_2}, {V.PRUNED_IN_FLIGHT, V.ILLEGAL_TRANSITION}),
    "pruning while another epoch is in flight": (
        variant(remove=[E(12, 1, "completed", "pruning", tx="begin"), E(13, 1, "pruning", "pruned", tx="finish")],
                add=[L(15.5, "acquired", 2, expires=30), E(16, 1, "completed", "pruning")]),
        {1: KEEP_2, 2: KEEP_2}, {V.PRUNED_WHILE_IN_FLIGHT}),
    "latest completed epoch pruned": (
        variant(add=[E(12, 4, "completed", "pruning", tx="begin")]),
        None, {V.PRUNED_LATEST_COMPLETED}),
    "epoch kept by keep_last pruned": (
        BASE, {1: {"keep_last": 3, "keep_newer_than_s": None}}, {V.PRUNED_RETAINED}),
    "epoch kept by keep_newer_than pruned": (
        BASE, {1: {"keep_last": None, "keep_newer_than_s": 60}}, {V.PRUNED_RETAINED}),
    "pruned without any lease": (
        variant(remove=[L(10, "acquired", 1, expires=20), L(11, "renewed", 1, expires=21),
                        L(14, "released", 1, expires=21)]),
        None, {V.PRUNED_WITHOUT_LOCK}),
    "pruned on an expired lease after somebody else ran": (
        variant(remove=[L(10, "acquired", 1, expires=20), L(11, "renewed", 1, expires=21),
                        E(15, 5, None, "triggered")],
                add=[L(10, "acquired", 1, expires=11), E(11.5, 5, None, "triggered"),
                     E(11.7, 5, "triggered", "completed"), E(15, 6, None, "triggered")]),
        None, {V.PRUNED_WITHOUT_LOCK}),
    "lease acquired while another run holds it": (
        variant(add=[L(12.5, "acquired", 2, expires=14.5)]),
        None, {V.LOCK_CONFLICT}),
    "live lease taken over": (
        variant(remove=[L(14, "released", 1, expires=21)],
                add=[L(14, "released", 1, expires=21, tx="take"), L(14, "acquired", 2, expires=14.5, tx="take")]),
        None, {V.LOCK_CONFLICT}),
    "lease renewed after it expired and somebody else ran": (
        variant(remove=[L(10, "acquired", 1, expires=20), E(15, 5, None, "triggered")],
                add=[L(10, "acquired", 1, expires=10.5), E(10.7, 5, None, "triggered"),
                     E(10.8, 5, "triggered", "completed"), E(15, 6, None, "triggered")]),
        None, {V.LOCK_CONFLICT}),
    "history out of time order": (
        [dataclasses.replace(ev, t=2.5) if ev == E(4, 3, None, "triggered") else ev for ev in BASE],
        None, {V.HISTORY_ORDER}),
    "two transactions interleaved": (
        [dataclasses.replace(ev, tx="a") if ev in (E(1, 1, "triggered", "completed"),
                                                   E(3, 2, "triggered", "completed")) else ev for ev in BASE],
        None, {V.INTERLEAVED_TRANSACTIONS}),
    "cleanup run without a readable policy": (
        BASE, {1: {}}, {V.UNKNOWN_POLICY}),
}


@pytest.mark.parametrize("case", list(BREACHES))
def test_checker_reports_each_kind_of_breach(scratch_dsn: str, case: str) -> None:
    events, policies, expected = BREACHES[case]
    report = checked(scratch_dsn, events, policies)
    assert report.kinds() == expected, "\n".join(str(v) for v in report.violations)
    with pytest.raises(AssertionError, match="protocol violations"):
        report.assert_clean()


LEGITIMATE: dict[str, list[Ev]] = {
    # the cleanup crashed: no release, the lease just expired; an epoch may start after that
    "trigger after a lease expired without a release": variant(
        remove=[L(14, "released", 1, expires=21), E(15, 5, None, "triggered")],
        add=[E(21.5, 5, None, "triggered")]),
    # the cleanup checked its lease just before it expired and nobody ran in between; it died then,
    # and the run that took the lease over finished the prune
    "prune recorded just after its lease expired, nobody in between": variant(
        remove=[L(11, "renewed", 1, expires=21), E(13, 1, "pruning", "pruned", tx="finish"),
                E(13, 3, "pruning", "pruned", tx="finish"), L(14, "released", 1, expires=21),
                E(15, 5, None, "triggered")],
        add=[L(11, "renewed", 1, expires=11.99),
             L(22, "released", 1, expires=11.99, tx="take"), L(22, "acquired", 2, expires=30, tx="take"),
             E(23, 1, "pruning", "pruned", tx="finish"), E(23, 3, "pruning", "pruned", tx="finish"),
             L(24, "released", 2, expires=30), E(25, 5, None, "triggered")]),
    # an expired lease taken over by another run
    "expired lease taken over": variant(
        remove=[L(14, "released", 1, expires=21), E(15, 5, None, "triggered")],
        add=[L(22, "released", 1, expires=21, tx="take"), L(22, "acquired", 2, expires=23, tx="take"),
             L(24, "released", 2, expires=23), E(25, 5, None, "triggered")]),
}


@pytest.mark.parametrize("case", list(LEGITIMATE))
def test_checker_accepts_legitimate_timing(scratch_dsn: str, case: str) -> None:
    report = checked(scratch_dsn, LEGITIMATE[case], {1: KEEP_2, 2: KEEP_2})
    assert report.violations == []


# ============================================================================= real histories

POLICY = CheckpointPolicy(interval=3600, timeout=3600)


def complete_epoch(store: EpochStore, pid: str) -> int:
    started = store.trigger_tick(pid, POLICY, force=True).started
    assert started is not None
    for stage in started.stages:
        store.ack_epoch(pid, started.epoch, stage)
    return started.epoch


def test_checker_passes_a_real_history_and_agrees_with_the_tables(store: EpochStore, migrated_dsn: str) -> None:
    store.register_pipeline("real", stages=["a", "b"], run_id="r1")
    store.set_pipeline_state("real", PipelineState.RUNNING)
    for _ in range(3):
        complete_epoch(store, "real")
    failed = store.trigger_tick("real", POLICY, force=True).started
    assert failed is not None
    store.fail_epoch("real", failed.epoch, "stage b could not snapshot")
    # a crashed cleanup: its lease expires without a release, the next run takes over
    crashed = store.acquire_cleanup_lock("real", "crashed", ttl=0.05, policy={"keep_last": 1})
    wait_for(lambda: store.cleanup_lock("real") is None, what="the crashed lease to expire")
    report = prune_pipeline(store, "real", RetentionPolicy(keep_last=1), holder="retention", lock_ttl=10)
    assert report.epochs_pruned == [1, 2, failed.epoch]
    complete_epoch(store, "real")

    history = check_history(migrated_dsn)
    assert history.violations == []
    assert history.counts["triggered"] == 5
    assert history.counts["completed"] == 4
    assert history.counts["failed"] == 1
    assert history.counts["pruned"] == 3
    assert history.counts["lock_takeover"] == 1
    runs = {r.id: r.state for r in store.list_cleanup_runs("real")}
    assert runs[crashed.id] == "lock_lost"


def test_checker_reports_tables_that_disagree_with_the_history(store: EpochStore, migrated_dsn: str) -> None:
    store.register_pipeline("real", stages=["a"], run_id="r1")
    store.set_pipeline_state("real", PipelineState.RUNNING)
    epoch = complete_epoch(store, "real")
    assert check_history(migrated_dsn).violations == []
    # change a state behind the history trigger's back
    sql(migrated_dsn, "ALTER TABLE arroyo_epochs DISABLE TRIGGER arroyo_epochs_history;"
                "UPDATE arroyo_epochs SET state = 'failed', failure_reason = 'x' WHERE epoch = %s;"
                "ALTER TABLE arroyo_epochs ENABLE TRIGGER arroyo_epochs_history", (epoch,))
    report = check_history(migrated_dsn)
    assert report.kinds() == {V.TABLE_MISMATCH}


def test_checker_catches_breaches_made_behind_the_stores_back(store: EpochStore, migrated_dsn: str) -> None:
    """Raw SQL that skips the store's rules: the database's triggers record it, the checker reports it."""
    store.register_pipeline("raw", stages=["a"], run_id="r1")
    store.set_pipeline_state("raw", PipelineState.RUNNING)
    first, second = complete_epoch(store, "raw"), complete_epoch(store, "raw")
    store.acquire_cleanup_lock("raw", "cleaner", ttl=60, policy={"keep_last": 1})
    # an epoch started although the cleanup lease is live (the store's trigger_tick would wait)
    sql(migrated_dsn, "INSERT INTO arroyo_epochs (pipeline_id, epoch, state, stages, timeout_at)"
                " VALUES ('raw', 3, 'triggered', '{a}', now() + interval '1 hour');"
                "UPDATE arroyo_pipelines SET last_epoch = 3 WHERE pipeline_id = 'raw'")
    # the latest completed epoch marked pruning (begin_prune refuses it)
    sql(migrated_dsn, "UPDATE arroyo_epochs SET state = 'pruning' WHERE pipeline_id = 'raw' AND epoch = %s", (second,))
    report = check_history(migrated_dsn)
    assert report.kinds() == {V.TRIGGERED_UNDER_LOCK, V.PRUNED_WHILE_IN_FLIGHT, V.PRUNED_LATEST_COMPLETED}
    assert first == 1


# ============================================================================= the chaos runs


@pytest.fixture
def storage(tmp_path: Path) -> str:
    root = tmp_path / "storage"
    root.mkdir()
    return str(root)


def config(dsn: str, storage_root: str) -> ChaosConfig:
    return ChaosConfig(dsn=dsn, pipeline_ids=("p1", "p2", "p3", "p4", "p5"), storage_root=storage_root,
                       trigger_mode=TRIGGER_MODE, interval=0.3, timeout=3.0, min_pause=0.05, keep_last=2,
                       keep_newer_than=1.0, lock_ttl=0.8, seed=int(uuid.uuid4()) % 10_000)


def describe(result: ChaosResult, report: HistoryReport) -> str:
    lines = [f"workers ready after {result.ready_seconds:.1f}s; history: {report.summary()}"]
    lines += [f"  {pid}: {dict(sorted(figures.items()))}" for pid, figures in sorted(report.per_pipeline.items())]
    lines += [f"  {w['name']} (retry {w['retry_seconds']}s): {w['counts']}" for w in result.workers]
    return "\n".join(lines)


def assert_workers_healthy(result: ChaosResult) -> None:
    assert result.missing == [], f"workers never reported: {result.missing}"
    assert result.killed == [], f"workers had to be killed: {result.killed}"
    assert result.errors() == [], "\n".join(result.errors())


def triggered_by(dsn: str) -> dict[str, int]:
    return dict(sql(dsn, "SELECT triggered_by, count(*) FROM arroyo_epochs GROUP BY 1"))  # type: ignore[arg-type]


@pytest.mark.slow
def test_many_triggers_and_cleanups_never_break_the_protocol(pg_dsn: str, storage: str) -> None:
    cfg = config(pg_dsn, storage)
    prepare_pipelines(cfg)
    result = run_chaos(cfg, triggers=8, cleaners=4, duration=20.0, start_method=START_METHOD)
    report = check_history(pg_dsn)
    print(describe(result, report))
    assert_workers_healthy(result)
    report.assert_clean()
    assert missing_objects(pg_dsn, storage) == []

    # the run exercised what it claims to prove
    for pid in cfg.pipeline_ids:
        figures = report.per_pipeline[pid]
        assert figures["triggered"] >= 5, (pid, figures)
        assert figures["completed"] >= 2, (pid, figures)
    for what in ("expired", "failed", "pruned", "lock_takeover", "lock_renewed"):
        assert report.counts[what] > 0, what
    assert len(triggered_by(pg_dsn)) >= 4, "epochs were started by a few trigger processes only"
    assert result.total("stall_refused") + result.total("lock_lost") > 0, "no cleanup lost its lease"


@pytest.mark.slow
@pytest.mark.usefixtures("tmp_path")
def test_everything_resumes_after_postgres_restarts(storage: str) -> None:
    pg = ThrowawayPostgres()
    pg.start()
    try:
        cfg = config(pg.dsn, storage)
        prepare_pipelines(cfg)

        def outage() -> None:
            """A restart with the server down for 1.5 s: longer than the short retry budget (0.3 s) of
            half of the workers, so they surely see TransientStoreError; shorter than the checkpoint
            timeout (3 s), past which a trigger ends by design."""
            pg.stop()
            time.sleep(1.5)
            pg.start()

        result = run_chaos(cfg, triggers=8, cleaners=4, duration=24.0, start_method=START_METHOD,
                           actions=[(7.0, "restart-1", pg.restart), (15.0, "restart-2", outage)])
        report = check_history(pg.dsn)
        print(describe(result, report))
        assert_workers_healthy(result)
        report.assert_clean()
        assert missing_objects(pg.dsn, storage) == []

        # after each restart (and before the next), epochs were triggered and completed again
        windows = [(result.marks["restart-1"][1], result.marks["restart-2"][0]),
                   (result.marks["restart-2"][1], result.stopped_at)]
        for begin, end in windows:
            window = [e for e in report.events if e.kind == "epoch_state" and begin < e.at < end]
            assert sum(e.new_state == EpochState.TRIGGERED for e in window) >= 5, (begin, end)
            assert sum(e.new_state == EpochState.COMPLETED for e in window) >= 3, (begin, end)
        # the outage reached the workers whose store retries briefly, and they went on
        assert result.total("transient_errors", role="cleanup") + result.total("transient_errors", role="acker") > 0
    finally:
        pg.cleanup()
