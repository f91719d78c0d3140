"""Load benchmark of the checkpoint controller: triggerer processes running N CheckpointTriggers.

    .venv/bin/python benchmarks/trigger_load.py                      # 1000 pipelines, 1 s; old, new, both in HA
    .venv/bin/python benchmarks/trigger_load.py --seconds 20         # a shorter window
    .venv/bin/python benchmarks/trigger_load.py --triggerers 1       # without the HA modes
    .venv/bin/python benchmarks/trigger_load.py --paths new          # only one path
    .venv/bin/python benchmarks/trigger_load.py --acker store        # fake pipelines ack via EpochStore
    .venv/bin/python benchmarks/trigger_load.py --stagger            # starts spread over one interval
    TRIGGER_LOAD_PROFILE=/tmp/p .venv/bin/python benchmarks/trigger_load.py ...  # + a sampling profile

What runs where:

* a throwaway PostgreSQL server (the epoch store);
* per mode, 1 or 2 triggerer processes (``--triggerers 1,2``), each ONE asyncio event loop running the
  same N ``CheckpointTrigger.run()`` generators, as a triggerer would (store reached through
  ``ArroyoHook`` and ``AIRFLOW_CONN_ARROYO_DEFAULT``); with 2, every pipeline has two copies of one
  trigger (triggerer HA);
* a separate acker process (its CPU does not count in the triggerer's figure): the fake pipelines.
  ``--acker sql`` (default) completes every in-flight epoch with one batched statement every 5 ms,
  under the pipelines' row locks and writing the rows ``ack_epoch`` would, and heartbeats every 2 s;
  ``--acker store`` calls ``EpochStore.ack_epoch`` once per stage, as pipeline drivers do.

The paths, each run with every triggerer count on fresh pipelines in one invocation (rounds
interleave the modes):

* ``old``: one ``trigger_tick`` transaction per pipeline per tick, each in its own worker thread
  (``AsyncEpochStore(coalesce=False)``), the trigger's own reads per epoch, and polling for an
  overdue epoch's end (doubling polls);
* ``new``: the loop's ticks coalesced into shared batch transactions with their report
  (``store/_coalesce.py``, ``store/_batch.py``), the loop's one LISTEN connection waking a trigger
  when its epoch ends (``WAKE_ON_NOTIFY``), HA followers that skip the ticks of the epochs they heard the
  leading copy start (``FOLLOWER_SKIPS``);
* ``new-ticking`` (not run by default): the new path with HA followers ticking once per epoch, as before
  they heard starts;
* ``new-3batches`` (not run by default): the new path with three batches of ticks in the database at once
  per triggerer, as before one was the default (``_coalesce.MAX_CONCURRENT``; ticks waiting for a lock still
  go alone beside them);
* ``new-slot-report`` (not run by default): the new path with each batch's report read before the next batch
  may enter the database, as before the report was read beside it (``_coalesce.REPORT_IN_SLOT``);
* ``new-separate`` (not run by default): the new path with a batch's row locks, the existence check, the
  facts and the watched epochs as four statements, as before they were one call (``ticks.ONE_CALL``,
  migration 0016);
* ``new-gc`` (not run by default): the new path without freezing the process's objects out of Python's
  cyclic garbage collector when the first trigger runs (``[arroyo] triggerer_freeze_gc``).

The measurement window is the parent's, common to a mode's processes: ``--warmup`` seconds after
every trigger has ticked once. What it prints per mode, for the epochs started inside the window:

* **schedule lateness**: ``triggered_at(n) - due(n)``, where ``due(n)`` is the point of the pipeline's
  fixed-rate schedule after ``triggered_at(n-1)`` (``airflow_arroyo.core.epochs.schedule_point_after``);
* **controller lateness**: counted from when epoch n could start at all
  (``max(due(n), ended_at(n-1))``): the trigger's part, not the acker's;
* epochs fired against the schedule's ``N * window / interval`` (a ratio);
* CPU seconds of the triggerer processes per epoch fired (``time.process_time()``: all threads);
* PostgreSQL CPU per epoch fired, by client (``/proc`` times of the server's processes);
* the store calls per epoch and how long each was awaited; the batches' sizes;
* the history checker's verdict on the mode's pipelines (``airflow_arroyo.devtools.history``);

then all modes side by side (and each new mode / the old one with as many triggerers).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STAGES = ["source", "sink"]


# --------------------------------------------------------------------------- the fake pipelines (own process)

ACK_ALL_SQL = """
WITH p AS (SELECT pipeline_id FROM arroyo_pipelines WHERE pipeline_id IN
             (SELECT pipeline_id FROM arroyo_epochs WHERE state = 'triggered')
           ORDER BY pipeline_id FOR UPDATE SKIP LOCKED),
e AS (SELECT pipeline_id, epoch, stages FROM arroyo_epochs WHERE state = 'triggered'
        AND pipeline_id IN (SELECT pipeline_id FROM p)),
a AS (INSERT INTO arroyo_acks (pipeline_id, epoch, stage, bytes_new, bytes_total)
      SELECT e.pipeline_id, e.epoch, s.stage, 1000, 100000 FROM e CROSS JOIN LATERAL unnest(e.stages) AS s(stage)
      ON CONFLICT DO NOTHING)
UPDATE arroyo_epochs x SET state = 'completed', ended_at = clock_timestamp(),
       bytes_new = 1000 * cardinality(e.stages), bytes_total = 100000 * cardinality(e.stages)
FROM e WHERE x.pipeline_id = e.pipeline_id AND x.epoch = e.epoch AND x.state = 'triggered'
"""
# The fake drivers heartbeat (every 2 s, all in one statement): a silent pipeline gets no epoch.
# Rows in id order, skipping those locked now (the next heartbeat, 2 s later, gets them; the bound is
# 30 s): an unordered UPDATE of every row deadlocked with the batches, which lock in id order.
HEARTBEAT_ALL_SQL = """
UPDATE arroyo_pipelines SET heartbeat_at = clock_timestamp() WHERE pipeline_id IN
  (SELECT pipeline_id FROM arroyo_pipelines WHERE state = 'running' ORDER BY pipeline_id FOR UPDATE SKIP LOCKED)
"""


def _heartbeat(conn: Any, last: float) -> float:
    if time.monotonic() - last < 2.0:
        return last
    with conn.cursor() as cur:
        cur.execute(HEARTBEAT_ALL_SQL)
    return time.monotonic()


def own_session() -> None:
    """With ``--own-sessions``: this process starts a session of its own. On Linux with
    ``sched_autogroup_enabled`` each session is one scheduling group with an equal share of the CPUs, as a
    triggerer run as a service of its own (its own host, container or cgroup) would have; without it the
    benchmark's triggerers and acker share one session's share."""
    if os.environ.get("TRIGGER_LOAD_OWN_SESSIONS") == "1":
        os.setsid()


def acker_sql_main(dsn: str, stop: Any, ready: Any, _threads: int) -> None:  # the ackers' signature
    """Complete every in-flight epoch of every pipeline in one statement, every 5 ms."""
    import psycopg2

    own_session()
    import psycopg2.errors

    conn = psycopg2.connect(dsn, application_name="acker")
    conn.autocommit = True
    ready.set()
    beat = 0.0
    while not stop.is_set():
        try:
            beat = _heartbeat(conn, beat)
            with conn.cursor() as cur:
                cur.execute(ACK_ALL_SQL)
        except psycopg2.errors.DeadlockDetected as exc:  # it must not happen (rows in id order), but says so
            print(f"acker: {exc}", file=sys.stderr)
        stop.wait(0.005)
    conn.close()


def acker_store_main(dsn: str, stop: Any, ready: Any, threads: int) -> None:
    """Acknowledge every stage of every in-flight epoch through ``EpochStore.ack_epoch``."""
    import psycopg2

    own_session()

    from airflow_arroyo.core.exceptions import ArroyoError
    from airflow_arroyo.store import EpochStore

    store = EpochStore(dsn, max_connections=threads + 1, application_name="acker")
    scan = psycopg2.connect(dsn, application_name="acker")
    scan.autocommit = True
    pool = ThreadPoolExecutor(threads)
    pending: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def ack(pid: str, epoch: int, stages: list[str]) -> None:
        try:
            for i, stage in enumerate(stages):
                store.ack_epoch(pid, epoch, stage, bytes_new=1000 + i, bytes_total=100_000 + i)
        except ArroyoError:
            pass  # the epoch ended meanwhile (its pipeline stopped): nothing to acknowledge
        finally:
            with lock:
                pending.discard((pid, epoch))

    ready.set()
    beat = 0.0
    while not stop.is_set():
        beat = _heartbeat(scan, beat)
        with scan.cursor() as cur:
            cur.execute("SELECT pipeline_id, epoch, stages FROM arroyo_epochs WHERE state = 'triggered'")
            rows = cur.fetchall()
        for pid, epoch, stages in rows:
            with lock:
                if (pid, epoch) in pending:
                    continue
                pending.add((pid, epoch))
            pool.submit(ack, pid, epoch, list(stages))
        stop.wait(0.005)
    pool.shutdown(wait=True)
    scan.close()
    store.close()


# --------------------------------------------------------------------------- the triggers (own processes)


@dataclass(frozen=True)
class Variant:
    name: str
    coalesce: bool  # ticks in shared batches (False: a transaction and a worker thread per tick)
    listen: bool  # woken by the database when an epoch ends (False: poll)
    follower_skips: int = 0  # FOLLOWER_SKIPS: HA followers skip ticks of the starts they heard (0: never)
    batches: int = 1  # _coalesce.MAX_CONCURRENT: batches of a triggerer in the database at once
    freeze_gc: bool = True  # [arroyo] triggerer_freeze_gc: gc.freeze() when the first trigger runs
    report_in_slot: bool = False  # _coalesce.REPORT_IN_SLOT: the next batch waits for the report's read
    max_batch: int = 128  # _coalesce.MAX_BATCH: most ticks in one batch
    long_queue_batches: int = 1  # _coalesce.LONG_QUEUE_BATCHES: more batches while a full batch waits
    one_call: bool = True  # ticks.ONE_CALL: a batch's locks, facts and ended epochs in one call (migration 0016)


OLD = Variant("old", coalesce=False, listen=False, freeze_gc=False)  # as first shipped
NEW = Variant("new", coalesce=True, listen=True, follower_skips=4)  # the trigger's FOLLOWER_SKIPS
NEW_TICKING = Variant("new-ticking", coalesce=True, listen=True)  # the new path, its HA followers ticking every epoch
NEW_3BATCHES = Variant("new-3batches", coalesce=True, listen=True, follower_skips=4, batches=3)  # as before
NEW_GC = Variant("new-gc", coalesce=True, listen=True, follower_skips=4, freeze_gc=False)  # full GC scans
NEW_SLOT_REPORT = Variant("new-slot-report", coalesce=True, listen=True, follower_skips=4,
                          report_in_slot=True)  # as before the report was read beside the next batch
NEW_SEPARATE = Variant("new-separate", coalesce=True, listen=True, follower_skips=4,
                       one_call=False, long_queue_batches=0)  # as before migration 0016 and LONG_QUEUE_BATCHES
NEW_512 = Variant("new-512", coalesce=True, listen=True, follower_skips=4, max_batch=512)  # larger batches
NEW_ONE_BATCH = Variant("new-one-batch", coalesce=True, listen=True, follower_skips=4,
                        long_queue_batches=0)  # never a second batch beside the one in the database
PATHS = {"old": OLD, "new": NEW, "new-ticking": NEW_TICKING, "new-3batches": NEW_3BATCHES, "new-gc": NEW_GC,
         "new-slot-report": NEW_SLOT_REPORT, "new-separate": NEW_SEPARATE, "new-512": NEW_512,
         "new-one-batch": NEW_ONE_BATCH}


@dataclass(frozen=True)
class Mode:
    """A path run by ``triggerers`` processes (2: triggerer HA, both run the same triggers)."""

    variant: Variant
    triggerers: int

    @property
    def name(self) -> str:
        return self.variant.name if self.triggerers == 1 else f"{self.variant.name} HA{self.triggerers}"


def setup_pipelines(prefix: str, n: int, dsn: str) -> list[str]:
    from airflow_arroyo.core.epochs import PipelineState
    from airflow_arroyo.store import EpochStore

    admin = EpochStore(dsn)
    admin.migrate()
    pids = [f"{prefix}-{i:04d}" for i in range(n)]
    for pid in pids:
        admin.register_pipeline(pid, stages=STAGES, run_id="r1")
        admin.set_pipeline_state(pid, PipelineState.RUNNING)
    admin.close()
    return pids


def instrument_store_calls(ticked: set[str]) -> dict[str, list[float]]:
    """Count and time the triggers' store calls as the event loop awaits them; ``ticked`` collects the
    pipelines whose trigger finished a tick."""
    from airflow_arroyo.store import AsyncEpochStore

    calls: dict[str, list[float]] = {}
    for name in ("trigger_tick", "get_epoch", "get_pipeline", "cleanup_lock", "db_now"):
        original = getattr(AsyncEpochStore, name)

        def timed(original: Any = original, name: str = name) -> Any:
            async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    result = await original(self, *args, **kwargs)
                    if name == "trigger_tick":
                        ticked.add(args[0])
                    return result
                finally:
                    calls.setdefault(name, []).append(time.monotonic() - t0)
            return call

        setattr(AsyncEpochStore, name, timed())
    return calls


def triggerer_main(variant: Variant, pids: list[str], interval: float, dsn: str, out: Any, phases: Any,
                   stagger: bool, tolerable: int) -> None:
    """One triggerer process: reports its window's figures, then (after ``stop``) its final events."""
    import logging

    own_session()

    logging.getLogger("airflow_arroyo").setLevel(logging.WARNING)
    try:
        from airflow._shared.logging.structlog import PER_LOGGER_LEVELS

        PER_LOGGER_LEVELS["airflow_arroyo"] = logging.WARNING  # one INFO line per epoch is not what we measure
    except ImportError:
        pass
    global SAMPLER
    profile = os.environ.get("TRIGGER_LOAD_PROFILE")
    sampler = SAMPLER = Sampler() if profile else None  # started with the window (run_triggers)
    try:
        asyncio.run(run_triggers(variant, pids, interval, dsn, out, phases, stagger, tolerable))
    finally:
        if sampler is not None and profile:
            sampler.dump(f"{profile}.{variant.name}.{os.getpid()}.txt")


SAMPLER: Sampler | None = None  # this process's profiler (TRIGGER_LOAD_PROFILE)


class Sampler:
    """A cheap sampling profiler over every thread of the process (``TRIGGER_LOAD_PROFILE=prefix``):
    every 5 ms, each thread's innermost frames are counted; the dump lists self and cumulative counts.
    It samples the measurement window only: started with the 1000 triggers, its walks of every thread's
    stack (holding the GIL) kept them from starting within the 300 s the parent waits."""

    def __init__(self) -> None:
        import collections

        self.self_counts: collections.Counter[str] = collections.Counter()
        self.cum_counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._me: int | None = None

    def start(self) -> None:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        self._me = thread.ident

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for ident, frame in sys._current_frames().items():
                if ident == self._me:
                    continue
                self.samples += 1
                seen: set[str] = set()
                f: Any = frame
                first = True
                while f is not None:
                    code = f.f_code
                    key = f"{code.co_filename.rsplit('site-packages/', 1)[-1]}:{code.co_firstlineno} {code.co_name}"
                    if first:
                        self.self_counts[key] += 1
                        first = False
                    if key not in seen:
                        self.cum_counts[key] += 1
                        seen.add(key)
                    f = f.f_back

    def dump(self, path: str) -> None:
        self._stop.set()
        with open(path, "w") as fh:
            fh.write(f"{self.samples} samples (all threads)\n== self ==\n")
            for key, n in self.self_counts.most_common(60):
                fh.write(f"{n:7d} {key}\n")
            fh.write("== cumulative ==\n")
            for key, n in self.cum_counts.most_common(120):
                fh.write(f"{n:7d} {key}\n")


async def run_triggers(variant: Variant, pids: list[str], interval: float, dsn: str, out: Any, phases: Any,
                       stagger: bool, tolerable: int) -> None:
    """The window is the parent's (``phases``: begin, end, stop events), the same for every triggerer
    process, whenever each of them finished starting."""
    begin, end, stop = phases
    import functools

    from airflow_arroyo.hooks import arroyo as hook_module
    from airflow_arroyo.store import AsyncEpochStore, _coalesce
    from airflow_arroyo.store import ticks as ticks_module
    from airflow_arroyo.store._coalesce import TickCoalescer
    from airflow_arroyo.store._listen import EpochListener
    from airflow_arroyo.triggers import checkpoint as trigger_module
    from airflow_arroyo.triggers.checkpoint import CheckpointTrigger

    os.environ["AIRFLOW_CONN_ARROYO_DEFAULT"] = dsn
    hook_module.AsyncEpochStore = functools.partial(  # type: ignore[attr-defined,assignment]  # the seam
        AsyncEpochStore, coalesce=variant.coalesce, listen=variant.listen)
    trigger_module.WAKE_ON_NOTIFY = variant.listen
    trigger_module.FOLLOWER_SKIPS = variant.follower_skips
    _coalesce.MAX_CONCURRENT = variant.batches
    _coalesce.REPORT_IN_SLOT = variant.report_in_slot
    ticks_module.ONE_CALL = variant.one_call
    _coalesce.MAX_BATCH = variant.max_batch
    _coalesce.LONG_QUEUE_BATCHES = variant.long_queue_batches
    os.environ["AIRFLOW__ARROYO__TRIGGERER_FREEZE_GC"] = str(variant.freeze_gc)
    ticked: set[str] = set()
    calls = instrument_store_calls(ticked)
    admin = hook_module.ArroyoHook().get_store()  # the same process-wide store the triggers use
    loop = asyncio.get_running_loop()

    async def drive(pid: str, delay: float) -> dict[str, Any]:
        await asyncio.sleep(delay)
        trigger = CheckpointTrigger(pid, interval=interval, tolerable_failures=tolerable,
                                    triggered_by="bench")  # one trigger, as HA runs it twice
        gen = cast(AsyncGenerator[Any, None], trigger.run())
        try:
            event = await anext(gen)
        finally:
            await gen.aclose()
        return dict(event.payload)

    loop_lag: list[float] = []

    async def probe() -> None:  # event-loop responsiveness: how late a 50 ms timer fires
        while True:
            t0 = loop.time()
            await asyncio.sleep(0.05)
            loop_lag.append(loop.time() - t0 - 0.05)

    def figures_of(what: Any) -> tuple[int, int, int, int, int]:
        batches = ticks = notes = skipped = waiting = 0
        for obj in list(admin._loop_helpers.values()):  # the coalescer and listener of this loop
            if isinstance(obj, what):
                batches += getattr(obj, "batches", 0)
                ticks += getattr(obj, "ticks", 0)
                notes += getattr(obj, "notifications", 0)
                skipped += getattr(obj, "skipped", 0)
                waiting += getattr(obj, "waiting_batches", 0)
        return batches, ticks, notes, skipped, waiting

    spread = interval / len(pids) if stagger else 0.0
    tasks = [asyncio.create_task(drive(pid, i * spread)) for i, pid in enumerate(pids)]
    prober = asyncio.create_task(probe())
    while len(ticked) < len(pids):  # started: every trigger has ticked (the warm-up counts from here)
        await asyncio.sleep(0.1)
    out.put(("ready", os.getpid(), None))
    # The window's edges are taken by a thread of their own, when the parent sets them: on the old
    # path the loop's default executor is queued up with ticks, and the loop itself may be late.
    marks: dict[str, tuple[float, float]] = {}

    def watch_phases() -> None:
        for name, event in (("begin", begin), ("end", end)):
            event.wait()
            marks[name] = (time.process_time(), time.monotonic())

    threading.Thread(target=watch_phases, daemon=True).start()

    async def reached(name: str) -> tuple[float, float]:
        while name not in marks:
            await asyncio.sleep(0.01)
        return marks[name]

    cpu0, wall0 = await reached("begin")
    if SAMPLER is not None:
        SAMPLER.start()
    b0, t0, _, s0, w0 = figures_of(TickCoalescer)
    n0 = figures_of(EpochListener)[2]
    lag_from = len(loop_lag)
    calls.clear()
    cpu1, wall1 = await reached("end")
    b1, t1, _, s1, w1 = figures_of(TickCoalescer)
    n1 = figures_of(EpochListener)[2]
    window_calls = {name: list(v) for name, v in calls.items()}
    prober.cancel()
    out.put(("window", os.getpid(), {"cpu": cpu1 - cpu0, "wall": wall1 - wall0,
                                     "loop_lag": loop_lag[lag_from:], "calls": window_calls,
                                     "batches": b1 - b0, "batched_ticks": t1 - t0, "notifications": n1 - n0,
                                     "skipped": s1 - s0, "waiting_batches": w1 - w0}))
    while not stop.is_set():  # the parent stops the pipelines: the triggers end
        await asyncio.sleep(0.05)
    events = await asyncio.wait_for(asyncio.gather(*tasks), timeout=180)
    out.put(("events", os.getpid(), [e["status"] for e in events]))


def stop_pipelines(dsn: str, pids: list[str]) -> None:
    """Stop every pipeline in one transaction, as ``set_pipeline_state(STOPPED)`` does one by one (under
    the row locks, in id order; the in-flight epochs fail): 1000 transactions queued behind the
    triggerers' batches would take minutes on a loaded machine."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute("SELECT 1 FROM arroyo_pipelines WHERE pipeline_id = ANY(%s) ORDER BY pipeline_id FOR UPDATE",
                        (pids,))
            cur.execute("UPDATE arroyo_epochs SET state = 'failed', ended_at = clock_timestamp(),"
                        " failure_reason = 'pipeline stopped' WHERE pipeline_id = ANY(%s) AND state = 'triggered'",
                        (pids,))
            cur.execute("UPDATE arroyo_pipelines SET state = 'stopped', updated_at = now() WHERE pipeline_id = ANY(%s)",
                        (pids,))
    finally:
        conn.close()


def db_cpu(data_dir: Path, dsn: str) -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by each PostgreSQL server process (Linux /proc), with whose work it is:
    the triggerers' connections (``airflow-arroyo``), the fake pipelines' (``acker``), the server's own
    (WAL writer, checkpointer, autovacuum...: ``server``) or any other."""
    import psycopg2

    postmaster = int((data_dir / "postmaster.pid").read_text().split()[0])
    conn = psycopg2.connect(dsn, application_name="bench-probe")
    try:
        with conn.cursor() as cur:
            cur.execute("SELECT pid, application_name, backend_type FROM pg_stat_activity")
            names = {pid: (app or "other") if kind == "client backend" else "server"
                     for pid, app, kind in cur.fetchall()}
    finally:
        conn.close()
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        if pid == postmaster or int(fields[1]) == postmaster:  # fields[1]: the parent's pid
            name = names.get(pid, "server")
            if name != "bench-probe":
                out[pid] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def db_cpu_between(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    used: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        used[name] = used.get(name, 0.0) + cpu - before.get(pid, (name, 0.0))[1]
    return used


def run_path(mode: Mode, pids: list[str], args: argparse.Namespace, dsn: str) -> dict[str, Any]:
    """Start the mode's triggerer processes on ``pids``; once all of them started their triggers, warm up,
    then measure one window common to all; stop the pipelines and collect the triggers' events."""
    from airflow_arroyo.store import EpochStore

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    begin, end, stop = ctx.Event(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=triggerer_main, args=(mode.variant, pids, args.interval, dsn, out, (begin, end, stop),
                                                      args.stagger, args.tolerable_failures), daemon=True)
             for _ in range(mode.triggerers)]
    for proc in procs:
        proc.start()
    for _ in procs:
        out.get(timeout=300)  # ready: its triggers run
    clock = EpochStore(dsn)
    try:
        time.sleep(args.warmup)
        window_start = clock.db_now()
        db0 = db_cpu(args.pg_data_dir, dsn)
        begin.set()
        time.sleep(args.seconds)
        end.set()
        db1 = db_cpu(args.pg_data_dir, dsn)
        window_end = clock.db_now()
    finally:
        clock.close()
    windows = [out.get(timeout=300)[2] for _ in procs]
    stop_pipelines(dsn, pids)
    stop.set()
    statuses: list[str] = []
    for _ in procs:
        statuses += out.get(timeout=300)[2]
    for proc in procs:
        proc.join(60)
    return {"window": (window_start, window_end), "cpu": sum(w["cpu"] for w in windows),
            "db_cpu": db_cpu_between(db0, db1),
            "wall": max(w["wall"] for w in windows),
            "loop_lag": [x for w in windows for x in w["loop_lag"]], "statuses": statuses,
            "calls": {k: [x for w in windows for x in w["calls"].get(k, [])] for w in windows for k in w["calls"]},
            "batches": sum(w["batches"] for w in windows), "batched_ticks": sum(w["batched_ticks"] for w in windows),
            "skipped": sum(w["skipped"] for w in windows),
            "waiting_batches": sum(w["waiting_batches"] for w in windows),
            "notifications": sum(w["notifications"] for w in windows)}


# --------------------------------------------------------------------------- figures


def cpu_pressure() -> float:
    """Microseconds so far in which some runnable task of the machine waited for a CPU (Linux PSI; 0 without it)."""
    try:
        first = Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except (OSError, IndexError):
        return 0.0
    return float(first.rsplit("total=", 1)[1])


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def figures(dsn: str, prefix: str, interval: float, window: tuple[datetime, datetime]) -> dict[str, Any]:
    import psycopg2

    from airflow_arroyo.core.epochs import schedule_phase, schedule_point_after
    from airflow_arroyo.devtools.history import check_history

    params = {"a": window[0], "b": window[1], "p": f"{prefix}-%"}
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT pipeline_id, triggered_at, prev_start, prev_end"
            " FROM (SELECT pipeline_id, triggered_at, lag(triggered_at) OVER w AS prev_start,"
            "              lag(ended_at) OVER w AS prev_end"
            "       FROM arroyo_epochs WHERE pipeline_id LIKE %(p)s"
            "       WINDOW w AS (PARTITION BY pipeline_id ORDER BY epoch)) e"
            " WHERE prev_start IS NOT NULL AND triggered_at >= %(a)s AND triggered_at < %(b)s",
            params,
        )
        rows = []
        for pid, start, prev_start, prev_end in cur.fetchall():  # the schedule's rule, not a copy of it
            due = schedule_point_after(prev_start, interval, schedule_phase(pid, interval))
            could = max(due, prev_end) if prev_end is not None else due
            rows.append(((start - due).total_seconds(), (start - could).total_seconds()))
        cur.execute("SELECT state, EXTRACT(EPOCH FROM ended_at - triggered_at) FROM arroyo_epochs"
                    " WHERE pipeline_id LIKE %(p)s AND triggered_at >= %(a)s AND triggered_at < %(b)s", params)
        epochs = cur.fetchall()
        cur.execute("SELECT pipeline_id FROM arroyo_pipelines WHERE pipeline_id LIKE %(p)s", params)
        pids = [r[0] for r in cur.fetchall()]
    conn.close()
    history = check_history(dsn, pids)
    states: dict[str, int] = {}
    for state, _ in epochs:
        states[state] = states.get(state, 0) + 1
    return {"schedule": [float(r[0]) for r in rows], "controller": [float(r[1]) for r in rows],
            "fired": len(epochs), "states": states,
            "acked": [float(d) for state, d in epochs if state == "completed"],
            "violations": [str(v) for v in history.violations]}


def merge(into: dict[str, Any], run: dict[str, Any], f: dict[str, Any], expected: float) -> None:
    """Add one round's figures to a path's totals."""
    for key in ("schedule", "controller", "acked", "violations"):
        into.setdefault(key, []).extend(f[key])
    into["loop_lag"] = into.get("loop_lag", []) + run["loop_lag"]
    for key, value in (("fired", f["fired"]), ("expected", expected), ("cpu", run["cpu"]), ("wall", run["wall"]),
                       ("ok", sum(s == "success" for s in run["statuses"])), ("events", len(run["statuses"])),
                       ("batches", run["batches"]), ("batched_ticks", run["batched_ticks"]),
                       ("skipped", run["skipped"]), ("waiting_batches", run["waiting_batches"]),
                       ("notifications", run["notifications"])):
        into[key] = into.get(key, 0) + value
    for name, used in run["db_cpu"].items():
        into.setdefault("db_cpu", {})[name] = into.get("db_cpu", {}).get(name, 0.0) + used
    for state, n in f["states"].items():
        into.setdefault("states", {})[state] = into.get("states", {}).get(state, 0) + n
    for name, durations in run["calls"].items():
        into.setdefault("calls", {}).setdefault(name, []).extend(durations)


def report(mode: Mode, args: argparse.Namespace, t: dict[str, Any]) -> dict[str, float]:
    print(f"[{mode.name}] {args.pipelines} CheckpointTriggers x {mode.triggerers} triggerer process(es), "
          f"interval {args.interval}s, {args.rounds} x {args.seconds:g}s windows after {args.warmup}s warm-up each, "
          f"{os.cpu_count()} CPUs, {args.acker} acker{', staggered starts' if args.stagger else ''}")
    print(f"  epochs fired        {t['fired']}  vs schedule {t['expected']:.0f}  ratio {t['fired'] / t['expected']:.3f}"
          f"   states {t.get('states', {})}")
    out = {"ratio": t["fired"] / t["expected"]}
    for name in ("schedule", "controller"):
        vals = [v * 1000 for v in t.get(name, [])]
        out[f"{name}_p50"], out[f"{name}_p99"] = pct(vals, 50), pct(vals, 99)
        out[f"{name}_max"] = max(vals, default=float("nan"))
        print(f"  {name + ' lateness':<19} p50 {out[name + '_p50']:8.1f} ms   p99 {out[name + '_p99']:8.1f} ms   "
              f"max {out[name + '_max']:8.1f} ms   (n={len(vals)})")
    acked = [v * 1000 for v in t.get("acked", [])]
    print(f"  acknowledged after  p50 {pct(acked, 50):8.1f} ms   p99 {pct(acked, 99):8.1f} ms   "
          "(the fake pipeline's speed)")
    lag = [v * 1000 for v in t["loop_lag"]]
    print(f"  event-loop lag      p50 {pct(lag, 50):8.1f} ms   p99 {pct(lag, 99):8.1f} ms   "
          f"max {max(lag, default=float('nan')):8.1f} ms   (50 ms timer, n={len(lag)})")
    out["cpu_ms"] = 1000 * t["cpu"] / max(t["fired"], 1)
    print(f"  triggerer CPU       {t['cpu']:.2f} s in {t['wall']:.1f} s wall "
          f"({100 * t['cpu'] / t['wall']:.0f}% of one core): {out['cpu_ms']:.2f} ms per epoch fired")
    db = t.get("db_cpu", {})
    out["db_cpu_ms"] = 1000 * sum(db.values()) / max(t["fired"], 1)
    print(f"  PostgreSQL CPU      {out['db_cpu_ms']:.2f} ms per epoch fired: "
          + ", ".join(f"{name} {1000 * v / max(t['fired'], 1):.2f} ms" for name, v in sorted(db.items()))
          + f"  ({100 * sum(db.values()) / t['wall']:.0f}% of one core)")
    for name, durations in sorted(t.get("calls", {}).items()):
        ms = [d * 1000 for d in durations]
        print(f"  store.{name:<13} {len(ms) / max(t['fired'], 1):5.2f} calls/epoch   awaited p50 {pct(ms, 50):7.1f} ms"
              f"   p99 {pct(ms, 99):7.1f} ms")
    if t["batches"]:
        print(f"  tick batches        {t['batches']} transactions for {t['batched_ticks']} ticks "
              f"({t['batched_ticks'] / t['batches']:.1f} per batch); {t['skipped']} ticks found their row held "
              f"and were asked for again, {t['waiting_batches']} batches of one waited for a lock")
    if t["notifications"]:
        print(f"  notifications       {t['notifications']} received ({t['notifications'] / max(t['fired'], 1):.2f} "
              "per epoch fired)")
    print(f"  final events        {t['ok']}/{t['events']} success")
    out["violations"] = len(t["violations"])
    out["success"] = t["ok"] / max(t["events"], 1)
    print(f"  history check       {len(t['violations'])} invariant violations")
    for v in t["violations"][:10]:
        print(f"    {v}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window per mode and round")
    parser.add_argument("--warmup", type=float, default=10.0,
                        help="seconds between the last triggerer process running its triggers and the window")
    parser.add_argument("--triggerers", default="1,2",
                        help="comma-separated triggerer process counts to run each path with (2: HA, both run the "
                             "same triggers)")
    parser.add_argument("--paths", default="old,new", help="comma-separated: old, new")
    parser.add_argument("--acker", choices=["sql", "store"], default="sql")
    parser.add_argument("--acker-threads", type=int, default=4, help="threads of the 'store' acker")
    parser.add_argument("--rounds", type=int, default=1, help="windows per mode, interleaved across modes")
    parser.add_argument("--tolerable-failures", type=int, default=3,
                        help="the triggers' tolerance (each tick reads this many + 2 of the newest epochs; it was "
                             "1000, which read every pipeline's whole history at every tick)")
    parser.add_argument("--stagger", action="store_true",
                        help="start the triggers spread over one interval (as tasks defer at different times), "
                             "not all at once")
    parser.add_argument("--own-sessions", action="store_true",
                        help="each triggerer process and the acker in a session of its own (a scheduling group of "
                             "its own under Linux's autogroup, as separate triggerer services would be)")
    args = parser.parse_args()
    if args.own_sessions:
        os.environ["TRIGGER_LOAD_OWN_SESSIONS"] = "1"  # read by the spawned processes

    from airflow_arroyo.devtools.postgres import ThrowawayPostgres

    modes = [Mode(PATHS[name.strip()], int(n)) for n in args.triggerers.split(",") for name in args.paths.split(",")]
    totals: dict[str, dict[str, Any]] = {m.name: {} for m in modes}
    windows: dict[str, list[tuple[float, float, float, int, float, float, float, float]]] = {}
    # per mode and window: (p99 ms, fired, load at the end, violations, p50 ms, max ms, load at the start, CPU pressure)
    with ThrowawayPostgres() as pg:
        args.pg_data_dir = pg.data_dir
        setup_pipelines("warm", 1, pg.dsn)  # migrate before the acker starts
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        target = acker_sql_main if args.acker == "sql" else acker_store_main
        acker = ctx.Process(target=target, args=(pg.dsn, stop, ready, args.acker_threads), daemon=True)
        acker.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the acker process did not start")
            # rounds interleave the modes (old new old new ...) so that a busy spell of the machine
            # does not land on one path only
            for rnd in range(args.rounds):
                for i, mode in enumerate(modes):
                    prefix = f"r{rnd}m{i}"
                    pids = setup_pipelines(prefix, args.pipelines, pg.dsn)
                    load0, pressure0, began = os.getloadavg()[0], cpu_pressure(), time.monotonic()
                    run = run_path(mode, pids, args, pg.dsn)  # the pressure over the run (its warm-up too)
                    pressure = (cpu_pressure() - pressure0) / 1e6 / (time.monotonic() - began)
                    window_s = (run["window"][1] - run["window"][0]).total_seconds()
                    f = figures(pg.dsn, prefix, args.interval, run["window"])
                    merge(totals[mode.name], run, f, args.pipelines * window_s / args.interval)
                    # each window on its own, with the machine's load over it: a busy machine's figure is a claim
                    # about every window, not about their pooled tail
                    fired = f["fired"] / (args.pipelines * window_s / args.interval)
                    late = [v * 1000 for v in f["schedule"]]
                    windows.setdefault(mode.name, []).append(
                        (pct(late, 99), fired, os.getloadavg()[0], len(f["violations"]), pct(late, 50),
                         max(late, default=float("nan")), load0, pressure))
                    print(f"  window {rnd + 1} [{mode.name}]: fired {100 * fired:.1f} %, "
                          f"lateness p50 {pct(late, 50):.1f}"
                          f" / p99 {pct(late, 99):.1f} / max {max(late, default=float('nan')):.1f} ms, load average"
                          f" (1 min) {load0:.1f} -> {os.getloadavg()[0]:.1f}, CPU pressure {100 * pressure:.0f} %",
                          flush=True)
        finally:
            stop.set()
            acker.join(30)
            if acker.is_alive():
                acker.terminate()

    summaries = [(m, report(m, args, totals[m.name])) for m in modes]
    print(f"side by side ({args.pipelines} pipelines, interval {args.interval:g}s, {args.rounds} x {args.seconds:g}s; "
          "HA: figures of both triggerers together):")
    print(f"  {'mode':<14} {'fired':>7} {'late p50':>10} {'late p99':>10} {'CPU/epoch':>10} {'violations':>10} "
          f"{'success':>8} {'DB CPU/epoch':>13}")
    for mode, m in summaries:
        print(f"  {mode.name:<14} {100 * m['ratio']:6.1f}% {m['schedule_p50']:8.1f}ms {m['schedule_p99']:8.1f}ms "
              f"{m['cpu_ms']:8.2f}ms {m['violations']:>10} {100 * m['success']:7.1f}% {m['db_cpu_ms']:11.2f}ms")
    if args.rounds > 1:
        print("per window (lateness p50 / p99 / max, fired, 1-minute load average before -> after, CPU pressure, "
              "violations):")
        for mode in modes:
            rows = windows.get(mode.name, [])
            worst = max((w[0] for w in rows), default=float("nan"))
            print(f"  {mode.name}   worst p99 {worst:.1f} ms")
            for i, (p99, fired, load, v, p50, top, load0, pressure) in enumerate(rows, 1):
                print(f"    {i}: {p50:.1f} / {p99:.1f} / {top:.1f} ms, {100 * fired:.1f} %, load {load0:.1f} -> "
                      f"{load:.1f}, pressure {100 * pressure:.0f} %, {v}")
    by_name = dict((mode.name, m) for mode, m in summaries)
    for mode, m in summaries:
        base = by_name.get(Mode(OLD, mode.triggerers).name)
        if mode.variant is OLD or base is None:
            continue

        def r(key: str, m: dict[str, float] = m, base: dict[str, float] = base) -> str:
            return f"{m[key] / base[key]:8.2f}x" if base[key] else "      n/a"

        print(f"  {mode.name + ' / old':<14} {r('ratio'):>7} {r('schedule_p50'):>10} {r('schedule_p99'):>10} "
              f"{r('cpu_ms'):>10}")


if __name__ == "__main__":
    main()
