"""Realistic epoch-store content for the UI tests, made through the store API.

Five pipelines:

* ``orders``   running, 30 s interval, 4 stages, 240 ended epochs (some failed, some expired),
               two cleanup runs that pruned the oldest 150, and epoch 241 in flight with 2 of 4 acks.
* ``clicks``   running, 20 s interval, 3 stages, 60 epochs of which the last 4 failed; a cleanup run
               lost its lease (taken over) and the one that took it over holds the lock now.
* ``payments`` stopped, 30 epochs all completed; an expired (not live) cleanup lease is left behind.
* ``sessions`` running, 60 s interval; its last checkpoint completed an hour ago (overdue) and the
               driver's heartbeat is 10 minutes old.
* ``fresh``    registered, no epoch yet.

The store API writes everything; afterwards the timestamps are moved into a plausible past in one
pass of SQL (durations and ack times chosen here), which is what a history spread over hours looks like.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg2
import psycopg2.extras

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.store import EpochStore


@dataclass
class EpochPlan:
    epoch: int
    outcome: str  # completed | failed | expired | in_flight
    duration_s: float
    acked_stages: list[str]
    stage_offsets_s: dict[str, float]  # stage -> seconds after trigger of its ack


@dataclass
class PipelinePlan:
    pipeline_id: str
    stages: list[str]
    interval_s: float
    epochs: list[EpochPlan] = field(default_factory=list)
    last_trigger_ago_s: float = 20.0  # how long before "now" the newest epoch was triggered


@dataclass
class Dataset:
    dsn: str
    plans: dict[str, PipelinePlan]
    now: datetime  # the database clock when the timestamps were laid out
    held_lock_run: int
    lost_lock_run: int
    orders_cleanup_runs: list[int]
    orders_pruned: list[int]

    def plan(self, pipeline_id: str) -> PipelinePlan:
        return self.plans[pipeline_id]


def _ack_figures(rng: random.Random, offset_s: float) -> dict[str, float | int]:
    align = offset_s * rng.uniform(0.05, 0.3)
    sync = offset_s * rng.uniform(0.02, 0.1)
    asyn = offset_s * rng.uniform(0.2, 0.5)
    return {"alignment_ms": round(align * 1000, 3), "sync_ms": round(sync * 1000, 3),
            "async_ms": round(asyn * 1000, 3)}


def _run_epochs(store: EpochStore, plan: PipelinePlan, rng: random.Random, n: int,
                outcomes: dict[int, str]) -> None:
    policy = CheckpointPolicy(interval=plan.interval_s)
    total = 50_000_000
    for i in range(1, n + 1):
        outcome = outcomes.get(i, "completed")
        tick = store.trigger_tick(plan.pipeline_id, policy, force=True)
        assert tick.started is not None, (plan.pipeline_id, i, tick.decision)
        epoch = tick.started.epoch
        duration = round(rng.uniform(0.6, 6.0), 3)
        stages = plan.stages
        offsets = {s: round(duration * (k + 1) / len(stages), 3) for k, s in enumerate(stages)}
        if outcome == "completed":
            acked = list(stages)
        elif outcome == "in_flight":
            acked = stages[: len(stages) // 2]
        else:
            acked = stages[: rng.randint(0, len(stages) - 1)]
        for s in acked:
            new = rng.randint(100_000, 4_000_000)
            total += new // 4
            store.ack_epoch(plan.pipeline_id, epoch, s, cursors={f"{s}_in": epoch * 100},
                            bytes_new=new, bytes_total=total // len(stages),
                            snapshot_uri=f"file:///data/{plan.pipeline_id}/snapshots/{epoch}/{s}",
                            **_ack_figures(rng, offsets[s]))  # type: ignore[arg-type]
        if outcome == "failed":
            store.fail_epoch(plan.pipeline_id, epoch, f"stage {stages[len(acked)]} could not snapshot: disk full")
        elif outcome == "expired":
            _force_expire(store, plan.pipeline_id, epoch, policy)
            duration = policy.effective_timeout  # an expired epoch ends at its timeout
        plan.epochs.append(EpochPlan(epoch, outcome, duration, acked, offsets))


def _force_expire(store: EpochStore, pipeline_id: str, epoch: int, policy: CheckpointPolicy) -> None:
    _sql(store, "UPDATE arroyo_epochs SET triggered_at = triggered_at - interval '1 hour',"
                " timeout_at = triggered_at - interval '1 hour' + interval '1 second'"
                " WHERE pipeline_id = %s AND epoch = %s", (pipeline_id, epoch))
    tick = store.trigger_tick(pipeline_id, policy, force=True)
    assert tick.expired is not None and tick.expired.epoch == epoch, tick


def _register(store: EpochStore, plan: PipelinePlan, state: PipelineState) -> None:
    store.register_pipeline(
        plan.pipeline_id, stages=plan.stages, run_id=f"{plan.pipeline_id}-run-1",
        channels={f"{s}_out": f"file:///data/{plan.pipeline_id}/channels/{s}_out" for s in plan.stages},
        storage_uri=f"file:///data/{plan.pipeline_id}", checkpoint_interval=plan.interval_s,
        spark_app_id=f"local-{abs(hash(plan.pipeline_id)) % 10**13:013d}",
        spark_ui_url="http://127.0.0.1:4040" if plan.pipeline_id != "clicks" else "javascript:alert(1)",
    )
    if state is not PipelineState.REGISTERED:
        store.set_pipeline_state(plan.pipeline_id, PipelineState.RUNNING)


def populate(store: EpochStore, seed: int = 7) -> Dataset:
    rng = random.Random(seed)
    plans = {
        "orders": PipelinePlan("orders", ["source_orders", "enrich", "aggregate", "sink"], 30.0,
                               last_trigger_ago_s=5.0),
        "clicks": PipelinePlan("clicks", ["source_clicks", "sessionize", "sink"], 20.0),
        "payments": PipelinePlan("payments", ["source_payments", "sink"], 30.0, last_trigger_ago_s=7200.0),
        "sessions": PipelinePlan("sessions", ["source_sessions", "sink"], 60.0, last_trigger_ago_s=3600.0),
        "fresh": PipelinePlan("fresh", ["source", "sink"], 10.0),
    }
    for pid, plan in plans.items():
        _register(store, plan, PipelineState.REGISTERED if pid == "fresh" else PipelineState.RUNNING)

    orders = plans["orders"]
    orders_outcomes = {i: "failed" for i in (12, 13, 57, 90, 150, 151, 200, 233)}
    orders_outcomes.update({i: "expired" for i in (40, 160, 161)})
    _run_epochs(store, orders, rng, 240, orders_outcomes)
    _run_epochs(store, plans["clicks"], rng, 60, {57: "failed", 58: "expired", 59: "failed", 60: "failed"})
    _run_epochs(store, plans["payments"], rng, 30, {})
    _run_epochs(store, plans["sessions"], rng, 12, {3: "failed"})

    # Two cleanup runs on orders: prune 1-100, then 101-150.
    orders_runs, pruned = [], []
    for lo, hi in ((1, 100), (101, 150)):
        run = store.acquire_cleanup_lock("orders", "retention__orders", ttl=600,
                                         policy={"keep_last": 90, "max_age_s": 86400})
        plan = store.begin_prune("orders", run.id, list(range(lo, hi + 1)))
        freed = {e: 1_000_000 + 1000 * e for e in plan.epochs}
        done = store.finish_prune("orders", run.id, freed)
        store.release_cleanup_lock("orders", run.id)
        orders_runs.append(run.id)
        pruned += done
    # Epoch 241 of orders in flight, 2 of 4 stages acknowledged.
    _run_epochs(store, orders, rng, 1, {1: "in_flight"})

    # clicks: a run that lost its lease, then one that took it over and holds it now.
    lost = store.acquire_cleanup_lock("clicks", "retention__clicks__crashed", ttl=60, policy={"keep_last": 20})
    _sql(store, "UPDATE arroyo_cleanup_locks SET acquired_at = clock_timestamp() - interval '2 hours',"
                " expires_at = clock_timestamp() - interval '1 hour' WHERE pipeline_id = 'clicks'")
    held = store.acquire_cleanup_lock("clicks", "retention__clicks", ttl=3600, policy={"keep_last": 20})
    _sql(store, "UPDATE arroyo_cleanup_runs SET started_at = clock_timestamp() - interval '2 hours'"
                " WHERE id = %s", (lost.id,))

    # payments: stopped, with an expired lease left behind by a crashed run.
    store.set_pipeline_state("payments", PipelineState.STOPPED)
    store.acquire_cleanup_lock("payments", "retention__payments__crashed", ttl=60)
    _sql(store, "UPDATE arroyo_cleanup_locks SET acquired_at = clock_timestamp() - interval '3 hours',"
                " expires_at = clock_timestamp() - interval '2 hours' WHERE pipeline_id = 'payments'")

    now = _lay_out_history(store, plans)
    return Dataset(dsn=store.dsn, plans=plans, now=now, held_lock_run=held.id, lost_lock_run=lost.id,
                   orders_cleanup_runs=orders_runs, orders_pruned=pruned)


def _sql(store: EpochStore, sql: str, params: tuple[object, ...] = ()) -> None:
    conn = psycopg2.connect(store.dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(sql, params)
    finally:
        conn.close()


def _lay_out_history(store: EpochStore, plans: dict[str, PipelinePlan]) -> datetime:
    """Move every timestamp into a plausible past: epoch k of a pipeline triggered one interval
    after epoch k-1, ending ``duration_s`` later; acks at their planned offsets."""
    conn = psycopg2.connect(store.dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT clock_timestamp()")
            now: datetime = cur.fetchone()[0]
            epoch_rows, ack_rows = [], []
            for plan in plans.values():
                if not plan.epochs:
                    continue
                # one in flight at a time: the next epoch starts an interval after the previous
                # one started, or when it ended if it took longer (an expired one)
                starts, t = [], 0.0
                for e in plan.epochs:
                    starts.append(t)
                    t += max(plan.interval_s, e.duration_s)
                shift = now - timedelta(seconds=plan.last_trigger_ago_s + starts[-1])
                for e, start in zip(plan.epochs, starts, strict=True):
                    trig = shift + timedelta(seconds=start)
                    ended = None if e.outcome == "in_flight" else trig + timedelta(seconds=e.duration_s)
                    timeout = CheckpointPolicy(interval=plan.interval_s).effective_timeout
                    epoch_rows.append((plan.pipeline_id, e.epoch, trig, ended, trig + timedelta(seconds=timeout)))
                    for s in e.acked_stages:
                        ack_rows.append((plan.pipeline_id, e.epoch, s, trig + timedelta(seconds=e.stage_offsets_s[s])))
            psycopg2.extras.execute_values(
                cur,
                "UPDATE arroyo_epochs e SET triggered_at = v.t, ended_at = v.ended, timeout_at = v.timeout"
                " FROM (VALUES %s) AS v(p, n, t, ended, timeout)"
                " WHERE e.pipeline_id = v.p AND e.epoch = v.n",
                epoch_rows, template="(%s, %s, %s::timestamptz, %s::timestamptz, %s::timestamptz)", page_size=500,
            )
            psycopg2.extras.execute_values(
                cur,
                "UPDATE arroyo_acks a SET acked_at = v.t FROM (VALUES %s) AS v(p, n, s, t)"
                " WHERE a.pipeline_id = v.p AND a.epoch = v.n AND a.stage = v.s",
                ack_rows, template="(%s, %s, %s, %s::timestamptz)", page_size=1000,
            )
            # Pruned epochs keep a plausible pruned_at (after they ended, before now).
            cur.execute("UPDATE arroyo_epochs SET pruned_at = LEAST(ended_at + interval '1 hour', %s)"
                        " WHERE pruned_at IS NOT NULL", (now,))
            cur.execute("SELECT id FROM arroyo_cleanup_runs WHERE pipeline_id = 'orders' ORDER BY id")
            for k, (run_id,) in enumerate(cur.fetchall()):
                started = now - timedelta(hours=4 - 2 * k)
                cur.execute("UPDATE arroyo_cleanup_runs SET started_at = %s, ended_at = %s WHERE id = %s",
                            (started, started + timedelta(seconds=42), run_id))
            heartbeats = {"orders": 4, "clicks": 9, "payments": 7300, "sessions": 600, "fresh": 2}
            for pid, ago in heartbeats.items():
                cur.execute("UPDATE arroyo_pipelines SET heartbeat_at = %s - make_interval(secs => %s),"
                            " updated_at = %s - interval '3 hours' WHERE pipeline_id = %s", (now, ago, now, pid))
            cur.execute("UPDATE arroyo_pipelines SET updated_at = %s - interval '30 seconds'"
                        " WHERE pipeline_id = 'fresh'", (now,))
            cur.execute("ANALYZE")  # planner statistics, as autovacuum keeps them on a live database
        return now
    finally:
        conn.close()

