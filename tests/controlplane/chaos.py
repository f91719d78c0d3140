"""Chaos for the control plane: many processes triggering, cleaning up and acknowledging at once.

The worker functions run in their own processes (``multiprocessing`` with ``spawn`` or
``forkserver``: nothing is inherited but their arguments), against the same pipelines of one epoch
store, until a shared stop event is set:

* :func:`trigger_worker` runs the checkpoint controller: the real
  :class:`~airflow_arroyo.triggers.checkpoint.CheckpointTrigger` in an asyncio loop, one trigger per
  pipeline (``trigger_mode="airflow"``), or its core, a loop of
  :meth:`~airflow_arroyo.store.EpochStore.trigger_tick` (``trigger_mode="store"``);
* :func:`cleanup_worker` runs :func:`~airflow_arroyo.core.retention.prune_pipeline` on random pipelines,
  and now and then a cleanup that crashes (leaves its lease and ``pruning`` epochs behind) or one
  that stalls past its lease and then tries to go on (the store must refuse it);
* :func:`acker_worker` is the fake pipeline: it sees each epoch in flight and acknowledges it for
  every stage after small random delays, records a small incremental snapshot per stage, or fails
  it, or acknowledges only some stages, or never (so it expires).

:func:`run_chaos` starts them, waits until every one is ready, lets them run for ``duration``
seconds (running ``actions`` such as a PostgreSQL restart at given offsets), stops them, collects
what each says it did and kills stragglers. The proof is not what the workers say: check the
database's own history with :func:`airflow_arroyo.devtools.history.check_history`.

Workers survive :class:`~airflow_arroyo.core.exceptions.TransientStoreError` (log, back off, go on);
anything unexpected is recorded in their result and the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import queue
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from airflow_arroyo.core.epochs import CheckpointPolicy, EpochState, PipelineState, RetentionPolicy, select_prunable
from airflow_arroyo.core.exceptions import (
    ArroyoError,
    CleanupLockHeld,
    ConcurrencyConflict,
    LockLostError,
    TransientStoreError,
)

_NAMESPACE_LEVELS = "AIRFLOW__LOGGING__NAMESPACE_LEVELS"

__all__ = [
    "ChaosConfig",
    "ChaosResult",
    "acker_worker",
    "cleanup_worker",
    "missing_objects",
    "prepare_pipelines",
    "run_chaos",
    "trigger_worker",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChaosConfig:
    """What the workers do (durations in seconds). Picklable: it is all a worker receives."""

    dsn: str
    pipeline_ids: tuple[str, ...] = ("p1", "p2", "p3", "p4", "p5")
    stages: tuple[str, ...] = ("source", "join", "sink")
    storage_root: str | None = None  # snapshot objects are written below it (None: no objects)
    trigger_mode: str = "store"  # "airflow": the real CheckpointTrigger; "store": its trigger_tick loop
    # checkpoint policy
    interval: float = 0.3
    poll: float = 0.5  # the real trigger's longest sleep between ticks
    timeout: float = 3.0
    min_pause: float = 0.05
    tolerable_failures: int = 1000
    # retention
    keep_last: int | None = 2
    keep_newer_than: float | None = 1.0
    lock_ttl: float = 0.8
    wait_for_in_flight: float = 0.4
    cleanup_pause: tuple[float, float] = (0.2, 0.8)
    crash_p: float = 0.08  # a cleanup that dies holding its lease (after marking epochs pruning)
    stall_p: float = 0.05  # a cleanup that stalls past its lease, then tries to prune
    # the fake pipeline
    ack_delay: float = 0.3  # each stage acks after uniform(0, ack_delay) seconds
    ack_never_p: float = 0.08
    ack_fail_p: float = 0.05
    ack_partial_p: float = 0.04
    acker_poll: float = 0.02
    ackers: int = 2  # acker processes; acker i acknowledges pipelines i, i + ackers, ...
    # store clients: workers alternate between these retry budgets (a short one surfaces
    # TransientStoreError during an outage, which the worker must survive)
    retry_seconds: tuple[float, ...] = (60.0, 0.3)
    seed: int = 0

    @property
    def checkpoint_policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(interval=self.interval, timeout=self.timeout, min_pause=self.min_pause,
                                tolerable_failures=self.tolerable_failures)

    @property
    def retention_policy(self) -> RetentionPolicy:
        return RetentionPolicy(keep_last=self.keep_last, keep_newer_than=None if self.keep_newer_than is None
                               else timedelta(seconds=self.keep_newer_than))

    def policy_json(self) -> dict[str, Any]:
        """The retention policy as cleanup runs record it (the form retention writes)."""
        return {"keep_last": self.keep_last, "keep_newer_than_s": self.keep_newer_than}


def prepare_pipelines(config: ChaosConfig) -> None:
    """Migrate the store and register every pipeline as running."""
    from airflow_arroyo.store import EpochStore

    store = EpochStore(config.dsn)
    try:
        store.migrate()
        for pid in config.pipeline_ids:
            store.register_pipeline(pid, stages=list(config.stages), run_id=f"chaos-{config.seed}",
                                    storage_uri=config.storage_root)
            store.set_pipeline_state(pid, PipelineState.RUNNING)
    finally:
        store.close()


# --------------------------------------------------------------------------- worker plumbing


class _Worker:
    """Counters, unexpected errors and the transient-error back-off of one worker process."""

    def __init__(self, role: str, name: str, config: ChaosConfig, index: int, stop: Any, out: Any) -> None:
        self.role = role
        self.name = name
        self.index = index
        self.config = config
        self.stop = stop
        self.out = out
        self.rng = random.Random(f"{config.seed}:{name}")
        self.retry_seconds = config.retry_seconds[index % len(config.retry_seconds)]
        self.pipelines = list(config.pipeline_ids)  # an acker narrows this to its share
        self.first_fates: list[str] | None = None  # an acker lane's fates of its first epochs (see _plan)
        self.counts: Counter[str] = Counter()
        self.errors: list[str] = []
        self._backoff = 0.05

    def store(self, max_connections: int = 4) -> Any:
        from airflow_arroyo.store import EpochStore

        return EpochStore(self.config.dsn, max_connections=max_connections, retry_seconds=self.retry_seconds,
                          application_name=f"arroyo-chaos-{self.name}")

    def lane(self, pipeline_id: str) -> _Worker:
        """A part of this worker for one pipeline, run in its own thread (merged back at the end)."""
        lane = _Worker(self.role, f"{self.name}/{pipeline_id}", self.config, self.index, self.stop, self.out)
        lane.retry_seconds = self.retry_seconds
        lane.pipelines = [pipeline_id]
        return lane

    def merge(self, other: _Worker) -> None:
        for key, value in other.counts.items():
            self.counts[key] = max(self.counts[key], value) if key.endswith("_max") else self.counts[key] + value
        self.errors.extend(other.errors)

    def ready(self) -> None:
        self.out.put(("ready", self.name, None))

    def ok(self) -> None:
        self._backoff = 0.05

    def transient(self, exc: TransientStoreError) -> None:
        """Log, back off (bounded, interrupted by stop), go on."""
        self.counts["transient_errors"] += 1
        log.warning("%s: epoch store unreachable, backing off %.2fs: %s", self.name, self._backoff, exc)
        self.stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, 1.0)

    def unexpected(self, what: str, exc: BaseException) -> None:
        self.counts["unexpected_errors"] += 1
        text = f"{self.name}: {what}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        log.error("%s", text)
        if len(self.errors) < 20:
            self.errors.append(text)
        self.stop.wait(0.1)

    def finish(self) -> None:
        self.out.put(("result", self.name, {"role": self.role, "name": self.name,
                                             "retry_seconds": self.retry_seconds,
                                             "counts": dict(self.counts), "errors": self.errors}))


def _setup_logging(name: str) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name} %(name)s %(levelname)s %(message)s")
    # the controller and retention log every epoch and wait at INFO: too much for hundreds of epochs
    logging.getLogger("airflow_arroyo").setLevel(logging.WARNING)


def _run_worker(role: str, body: Callable[[_Worker], None], config: ChaosConfig, name: str, index: int,
                stop: Any, out: Any) -> None:
    _setup_logging(name)
    w = _Worker(role, name, config, index, stop, out)
    try:
        body(w)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        w.unexpected("worker died", exc)
    finally:
        w.finish()


# --------------------------------------------------------------------------- triggers


def trigger_worker(config: ChaosConfig, name: str, index: int, stop: Any, out: Any) -> None:
    """Run the checkpoint controller for every pipeline until ``stop`` is set."""
    body = _airflow_triggers if config.trigger_mode == "airflow" else _store_triggers
    _run_worker("trigger", body, config, name, index, stop, out)


def _store_triggers(w: _Worker) -> None:
    """The controller's core: ``trigger_tick`` per pipeline, sleeping until the next decision is due."""
    store = w.store()
    policy = w.config.checkpoint_policy
    pids = list(w.config.pipeline_ids)
    store.db_now()
    w.ready()
    try:
        while not w.stop.is_set():
            w.rng.shuffle(pids)
            delay = policy.interval
            for pid in pids:
                try:
                    tick = store.trigger_tick(pid, policy, triggered_by=w.name)
                except TransientStoreError as exc:
                    w.transient(exc)
                    continue
                except ArroyoError as exc:
                    w.unexpected(f"trigger_tick({pid})", exc)
                    continue
                w.ok()
                w.counts[f"tick_{tick.decision.action.value}"] += 1
                if tick.started is not None:
                    w.counts["started"] += 1
                if tick.expired is not None:
                    w.counts["expired"] += 1
                if tick.decision.recheck_at is not None:
                    delay = min(delay, max((tick.decision.recheck_at - tick.now).total_seconds(), 0.0))
            # jitter so that the triggers of different processes collide at random
            w.stop.wait(min(delay, policy.interval) + w.rng.uniform(0.0, policy.interval / 3))
    finally:
        store.close()


def _airflow_triggers(w: _Worker) -> None:
    """The real CheckpointTrigger, one per pipeline, in this process's event loop (as a triggerer
    runs them). Several processes run the same triggers, as triggerer HA does."""
    from airflow_arroyo.store import AsyncEpochStore
    from airflow_arroyo.triggers.checkpoint import CheckpointTrigger

    store = AsyncEpochStore(w.store())

    class ChaosTrigger(CheckpointTrigger):
        async def _open_store(self) -> AsyncEpochStore:  # the seam: our DSN and retry budget
            return store

    cfg = w.config

    async def one(pid: str) -> None:
        while not w.stop.is_set():
            trigger = ChaosTrigger(pid, interval=cfg.interval, timeout=cfg.timeout, min_pause=cfg.min_pause,
                                   tolerable_failures=cfg.tolerable_failures, poll_interval=cfg.poll,
                                   triggered_by=w.name)
            async for event in trigger.run():
                payload = event.payload
                w.counts[f"trigger_ended_{payload.get('reason')}"] += 1
                if payload.get("reason") == "store_error" and "unreachable" in str(payload.get("message")):
                    # an outage longer than the checkpoint timeout ends the trigger by design; Airflow
                    # would retry the task: start it again
                    log.warning("%s: trigger of %s ended: %s; starting it again", w.name, pid,
                                payload.get("message"))
                    continue
                w.unexpected(f"trigger of {pid} ended", RuntimeError(str(payload.get("message"))))

    async def main() -> None:
        await asyncio.to_thread(store.sync.db_now)
        w.ready()
        tasks = [asyncio.create_task(one(pid)) for pid in cfg.pipeline_ids]
        while not w.stop.is_set() and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except asyncio.CancelledError:
                pass
            except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
                w.unexpected("trigger task", exc)

    try:
        asyncio.run(main())
    finally:
        store.sync.close()


# --------------------------------------------------------------------------- cleanup


class _LocalFiles:
    """The filesystem seam of retention for a local storage root (paths are relative to it)."""

    def __init__(self, root: str) -> None:
        self.root = root

    def delete(self, path: str) -> bool:
        try:
            os.unlink(os.path.join(self.root, path))
        except FileNotFoundError:
            return False
        return True


def _no_channel(uri: str) -> None:
    return None


def cleanup_worker(config: ChaosConfig, name: str, index: int, stop: Any, out: Any) -> None:
    """Run retention on random pipelines until ``stop`` is set (with crashes and stalls)."""
    _run_worker("cleanup", _cleanup_loop, config, name, index, stop, out)


def _cleanup_loop(w: _Worker) -> None:
    from airflow_arroyo.core.retention import prune_pipeline

    cfg = w.config
    store = w.store()
    policy = cfg.retention_policy
    store.db_now()
    w.ready()
    n = 0
    try:
        while not w.stop.is_set():
            n += 1
            pid = w.rng.choice(cfg.pipeline_ids)
            holder = f"{w.name}#{n}"
            # every worker's 2nd run crashes and its 4th stalls, so a short run surely has both
            r = {2: 0.0, 4: cfg.crash_p}.get(n, w.rng.random())
            try:
                if r < cfg.crash_p:
                    _crashing_cleanup(w, store, pid, holder)
                elif r < cfg.crash_p + cfg.stall_p:
                    _stalling_cleanup(w, store, pid, holder)
                else:
                    report = prune_pipeline(
                        store, pid, policy, holder=holder, lock_ttl=cfg.lock_ttl,
                        wait_for_in_flight=timedelta(seconds=cfg.wait_for_in_flight),
                        poll_interval=min(0.05, cfg.lock_ttl / 4), fs_for=_LocalFiles, open_channel=_no_channel,
                    )
                    if report.skipped_reason is None:
                        w.counts["runs"] += 1
                        w.counts["epochs_pruned"] += len(report.epochs_pruned)
                        w.counts["objects_deleted"] += report.objects_deleted
                    elif "lock held" in report.skipped_reason:
                        w.counts["skipped_lock_held"] += 1
                    else:
                        w.counts["skipped_in_flight"] += 1
                w.ok()
            except LockLostError:
                w.counts["lock_lost"] += 1
            except TransientStoreError as exc:
                w.transient(exc)
            except ArroyoError as exc:
                w.unexpected(f"cleanup of {pid}", exc)
            w.stop.wait(w.rng.uniform(*cfg.cleanup_pause))
    finally:
        store.close()


def _crashing_cleanup(w: _Worker, store: Any, pid: str, holder: str) -> None:
    """Take the lease, mark what the policy prunes as ``pruning`` (unless an epoch is in flight), and
    die: no deletion, no release. The lease expires; a later run takes over and finishes."""
    try:
        run = store.acquire_cleanup_lock(pid, holder, ttl=w.config.lock_ttl, policy=w.config.policy_json())
    except CleanupLockHeld:
        w.counts["crash_skipped_lock_held"] += 1
        return
    w.counts["crashed"] += 1
    if store.in_flight_epoch(pid) is not None:
        return
    facts = [_facts(r) for r in store.unpruned_epochs(pid)]
    selection = select_prunable(facts, w.config.retention_policy, store.db_now())
    if selection.prune:
        plan = store.begin_prune(pid, run.id, selection.prune)
        w.counts["crash_left_pruning"] += len(plan.epochs)


def _stalling_cleanup(w: _Worker, store: Any, pid: str, holder: str) -> None:
    """Take the lease, stall until it expired, then try to prune: the store must refuse."""
    try:
        run = store.acquire_cleanup_lock(pid, holder, ttl=w.config.lock_ttl, policy=w.config.policy_json())
    except CleanupLockHeld:
        w.counts["stall_skipped_lock_held"] += 1
        return
    w.counts["stalled"] += 1
    lease = store.cleanup_lock(pid)
    expires = lease.expires_at if lease is not None and lease.cleanup_run == run.id else None
    while expires is not None and store.db_now() <= expires and not w.stop.is_set():
        w.stop.wait(0.05)
    if w.stop.is_set() and expires is not None and store.db_now() <= expires:
        store.release_cleanup_lock(pid, run.id, state="failed", error="chaos: stopped while stalling")
        return
    facts = [_facts(r) for r in store.unpruned_epochs(pid)]
    selection = select_prunable(facts, w.config.retention_policy, store.db_now())
    try:
        store.begin_prune(pid, run.id, list(selection.prune) or [1])
    except LockLostError:
        w.counts["stall_refused"] += 1
        store.release_cleanup_lock(pid, run.id, state="lock_lost", error="chaos: stalled past the lease")
        return
    w.unexpected(f"stalled cleanup of {pid}",
                 AssertionError(f"begin_prune accepted cleanup run {run.id} after its lease expired"))


def _facts(rec: Any) -> Any:
    from airflow_arroyo.core.epochs import EpochFacts

    return EpochFacts(rec.epoch, rec.state, rec.triggered_at, rec.ended_at)


# --------------------------------------------------------------------------- the fake pipeline


@dataclass
class _Plan:
    fate: str  # complete | fail | partial | never
    due: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, stage or "!fail")


def acker_worker(config: ChaosConfig, name: str, index: int, stop: Any, out: Any) -> None:
    """Acknowledge in-flight epochs for every stage after random delays (sometimes fail, sometimes
    only some stages, sometimes never), until ``stop`` is set."""
    _run_worker("acker", _ack_loop, config, name, index, stop, out)


def _ack_loop(w: _Worker) -> None:
    """One thread per pipeline of this acker's share, as every pipeline has its own driver: a slow
    acknowledgement of one pipeline must not hold back the others'."""
    cfg = w.config
    pipelines = list(cfg.pipeline_ids[w.index::cfg.ackers])
    store = w.store(max_connections=len(pipelines) + 1)
    store.db_now()
    lanes = [w.lane(pid) for pid in pipelines]
    threads = [threading.Thread(target=_ack_lane, args=(lane, store), name=lane.name, daemon=True)
               for lane in lanes]
    w.ready()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        store.close()
        for lane in lanes:
            w.merge(lane)


def _ack_lane(w: _Worker, store: Any) -> None:
    plans: dict[tuple[str, int], _Plan] = {}
    versions: dict[tuple[str, str], int] = {}  # (pipeline, stage) -> current state-file version
    planned: dict[str, int] = {}  # pipeline -> newest epoch given a fate
    beat = 0.0
    while not w.stop.is_set():
        try:
            if time.monotonic() - beat >= 2.0:  # the driver heartbeats (a silent one gets no epoch)
                for pid in w.pipelines:
                    store.heartbeat(pid, f"chaos-{w.config.seed}")
                beat = time.monotonic()
            _ack_round(w, store, plans, versions, planned)
            w.ok()
        except TransientStoreError as exc:
            w.transient(exc)
        except ArroyoError as exc:
            w.unexpected("ack round", exc)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the run
            w.unexpected("ack thread", exc)
        w.stop.wait(w.config.acker_poll)


def _ack_round(w: _Worker, store: Any, plans: dict[tuple[str, int], _Plan],
               versions: dict[tuple[str, str], int], planned: dict[str, int]) -> None:
    cfg = w.config
    now = time.monotonic()
    for pid in w.pipelines:
        rec = store.in_flight_epoch(pid)
        if rec is None or rec.epoch <= planned.get(pid, 0):  # epochs increase: one fate per epoch
            continue
        planned[pid] = rec.epoch
        plans[(pid, rec.epoch)] = _plan(w, rec.stages, now)
        w.counts[f"fate_{plans[(pid, rec.epoch)].fate}"] += 1
        lag_ms = int((datetime.now(UTC) - rec.triggered_at).total_seconds() * 1000)
        w.counts["seen_lag_ms_total"] += lag_ms
        w.counts["seen_lag_ms_max"] = max(w.counts["seen_lag_ms_max"], lag_ms)
    for (pid, epoch), plan in list(plans.items()):
        while plan.due and plan.due[0][0] <= now:
            due, stage = plan.due.pop(0)
            if stage == "!fail":
                state = store.fail_epoch(pid, epoch, "chaos: a stage could not snapshot")
                w.counts[f"fail_{state.value}"] += 1
                plan.due.clear()
                break
            t0 = time.monotonic()
            if cfg.storage_root:
                try:
                    _snapshot(w, store, pid, epoch, stage, versions)
                except ConcurrencyConflict:
                    # so late (a stalled acker on a loaded machine) that the epoch expired and a cleanup
                    # took it: the store refuses the snapshot by design, and the epoch is over
                    w.counts["snapshot_too_late"] += 1
                    plan.due.clear()
                    break
            state = store.ack_epoch(pid, epoch, stage, cursors={}, alignment_ms=w.rng.uniform(0, 5),
                                    sync_ms=w.rng.uniform(0, 5), async_ms=w.rng.uniform(0, 50),
                                    bytes_new=w.rng.randrange(0, 4096), bytes_total=4096)
            w.counts[f"ack_{state.value}"] += 1
            ack_ms = int((time.monotonic() - t0) * 1000)
            w.counts["ack_ms_total"] += ack_ms
            w.counts["ack_ms_max"] = max(w.counts["ack_ms_max"], ack_ms)
            w.counts["ack_late_ms_max"] = max(w.counts["ack_late_ms_max"], int((time.monotonic() - due) * 1000))
            if state is not EpochState.TRIGGERED:
                plan.due.clear()
        if not plan.due:
            del plans[(pid, epoch)]


# The first epochs of every pipeline get each fate once, in a random order, so that a short run
# surely sees every outcome; later epochs draw their fate with the configured probabilities.
_FIRST_FATES = ("never", "fail", "partial", "complete", "complete", "complete", "complete", "complete")


def _plan(w: _Worker, stages: Sequence[str], now: float) -> _Plan:
    cfg = w.config
    if w.first_fates is None:
        w.first_fates = list(_FIRST_FATES)
        w.rng.shuffle(w.first_fates)
    fate = w.first_fates.pop() if w.first_fates else _draw_fate(w)
    delays = sorted((now + w.rng.uniform(0, cfg.ack_delay), s) for s in stages)
    if fate == "never":
        return _Plan("never")
    if fate == "fail":
        return _Plan("fail", delays[: w.rng.randrange(len(delays))] + [(now + cfg.ack_delay, "!fail")])
    if fate == "partial" and len(delays) > 1:
        return _Plan("partial", delays[:-1])
    return _Plan("complete", delays)


def _draw_fate(w: _Worker) -> str:
    cfg = w.config
    r = w.rng.random()
    for fate, p in (("never", cfg.ack_never_p), ("fail", cfg.ack_fail_p), ("partial", cfg.ack_partial_p)):
        if r < p:
            return fate
        r -= p
    return "complete"


def _snapshot(w: _Worker, store: Any, pid: str, epoch: int, stage: str, versions: dict[tuple[str, str], int]) -> None:
    """A small incremental snapshot: the stage's state file changes every few epochs; unchanged
    files are referenced, not rewritten. Written before the ack, as a stage does."""
    from airflow_arroyo.runtime.layout import object_path
    from airflow_arroyo.store import SnapshotEntry

    assert w.config.storage_root is not None
    if (pid, stage) not in versions or w.rng.random() < 0.4:
        versions[(pid, stage)] = epoch
    keys = [f"{stage}/state-{versions[(pid, stage)]}", f"{stage}/offsets-{epoch}"]
    entries = []
    for key in keys:
        path = Path(w.config.storage_root) / object_path(pid, key)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * 64)
        entries.append(SnapshotEntry(rel_path=key.split("/", 1)[1], object_key=key, bytes=64))
    store.record_snapshot(pid, epoch, stage, entries)


def missing_objects(dsn: str, storage_root: str) -> list[str]:
    """Snapshot objects a restorable (completed) epoch references that are not on disk."""
    import psycopg2

    from airflow_arroyo.runtime.layout import object_path

    conn = psycopg2.connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT DISTINCT eo.pipeline_id, eo.epoch, eo.object_key FROM arroyo_epoch_objects eo"
                        " JOIN arroyo_epochs e USING (pipeline_id, epoch) WHERE e.state = 'completed'")
            rows = cur.fetchall()
    finally:
        conn.close()
    return [f"{pid} epoch {epoch}: {key}" for pid, epoch, key in rows
            if not (Path(storage_root) / object_path(pid, key)).exists()]


# --------------------------------------------------------------------------- the run


@dataclass
class ChaosResult:
    """What the workers said they did. Not the proof: check the database's history."""

    workers: list[dict[str, Any]]
    missing: list[str]  # workers that never reported
    killed: list[str]  # workers that had to be killed
    started_at: datetime
    stopped_at: datetime
    marks: dict[str, tuple[datetime, datetime]]  # action name -> (began, ended), wall clock UTC
    ready_seconds: float

    def errors(self) -> list[str]:
        return [e for w in self.workers for e in w["errors"]]

    def total(self, counter: str, role: str | None = None) -> int:
        return sum(w["counts"].get(counter, 0) for w in self.workers if role is None or w["role"] == role)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_chaos(
    config: ChaosConfig,
    *,
    triggers: int = 8,
    cleaners: int = 4,
    duration: float = 20.0,
    actions: Sequence[tuple[float, str, Callable[[], None]]] = (),
    start_method: str = "spawn",
    ready_timeout: float = 180.0,
    join_timeout: float = 20.0,
) -> ChaosResult:
    """Run the workers for ``duration`` seconds after all are ready; ``actions`` are
    ``(offset seconds, name, function)`` run in this process meanwhile (e.g. a PostgreSQL restart)."""
    ctx: Any = multiprocessing.get_context(start_method)
    if start_method == "forkserver":
        preload = ["tests.controlplane.chaos", "airflow_arroyo.core.retention", "airflow_arroyo.store"]
        if config.trigger_mode == "airflow":
            preload.append("airflow_arroyo.triggers.checkpoint")
        ctx.set_forkserver_preload(preload)
    stop = ctx.Event()
    targets: list[tuple[str, Callable[..., None], int]] = (
        [(f"trigger-{i}", trigger_worker, i) for i in range(triggers)]
        + [(f"cleanup-{i}", cleanup_worker, i) for i in range(cleaners)]
        + [(f"acker-{i}", acker_worker, i) for i in range(config.ackers)]
    )
    crew = _Crew(ctx, config, targets, stop)
    marks: dict[str, tuple[datetime, datetime]] = {}
    t0 = time.monotonic()
    crew.start()
    try:
        crew.wait_ready(ready_timeout)
        ready_seconds = time.monotonic() - t0
        started_at = datetime.now(UTC)
        start = time.monotonic()
        for offset, name, action in sorted(actions, key=lambda a: a[0]):
            pause = start + offset - time.monotonic()
            if pause > 0:
                stop.wait(pause)
            began = datetime.now(UTC)
            action()
            marks[name] = (began, datetime.now(UTC))
        pause = start + duration - time.monotonic()
        if pause > 0:
            stop.wait(pause)
    finally:
        stop.set()
        stopped_at = datetime.now(UTC)
        killed = crew.collect(join_timeout)
    return ChaosResult(
        workers=[crew.results[n] for n in crew.procs if n in crew.results],
        missing=[n for n in crew.procs if n not in crew.results],
        killed=killed,
        started_at=started_at,
        stopped_at=stopped_at,
        marks=marks,
        ready_seconds=ready_seconds,
    )


class _Crew:
    """The worker processes of one chaos run and what they reported."""

    def __init__(self, ctx: Any, config: ChaosConfig, targets: list[tuple[str, Callable[..., None], int]],
                 stop: Any) -> None:
        self.out = ctx.Queue()
        self.procs = {name: ctx.Process(target=fn, args=(config, name, i, stop, self.out), name=name, daemon=True)
                      for name, fn, i in targets}
        self.results: dict[str, dict[str, Any]] = {}
        self.ready: set[str] = set()

    def start(self) -> None:
        """Start every worker. Airflow reads ``[logging] namespace_levels`` when a process first imports it
        (a forkserver preloading the trigger, or each spawned worker): the triggers' INFO lines (every epoch,
        every wait, from every process) would cost CPU the run needs. Set for the starts only."""
        before = os.environ.get(_NAMESPACE_LEVELS)
        os.environ[_NAMESPACE_LEVELS] = "airflow_arroyo=WARNING"
        try:
            for p in self.procs.values():
                p.start()
        finally:
            if before is None:
                del os.environ[_NAMESPACE_LEVELS]
            else:
                os.environ[_NAMESPACE_LEVELS] = before

    def drain(self, timeout: float) -> None:
        kind, name, payload = self.out.get(timeout=timeout)
        self.ready.add(name)
        if kind != "ready":
            self.results[name] = payload

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ready) < len(self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"chaos workers not ready after {timeout}s: {sorted(set(self.procs) - self.ready)}")
            try:
                self.drain(0.2)
            except queue.Empty:
                dead = [n for n, p in self.procs.items() if n not in self.ready and not p.is_alive()]
                if dead:
                    raise RuntimeError(f"chaos workers died before they were ready: {dead}") from None

    def collect(self, timeout: float) -> list[str]:
        """Collect every result (within ``timeout``), join the workers and kill stragglers; returns those."""
        deadline = time.monotonic() + timeout
        while len(self.results) < len(self.procs) and time.monotonic() < deadline:
            try:
                self.drain(0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in self.procs.values()):
                    with contextlib.suppress(queue.Empty):
                        while True:
                            self.drain(0.5)
                    break
        killed: list[str] = []
        for name, p in self.procs.items():
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                killed.append(name)
                p.kill()
                p.join(5)
        self.out.close()
        return killed
