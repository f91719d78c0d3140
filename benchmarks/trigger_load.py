"""Load benchmark of the checkpoint controller: one event loop running N CheckpointTriggers.

    .venv/bin/python benchmarks/trigger_load.py                   # 200 pipelines, 1 s interval, 60 s
    .venv/bin/python benchmarks/trigger_load.py --seconds 20      # a shorter window
    .venv/bin/python benchmarks/trigger_load.py --compare         # variants side by side, one run
    .venv/bin/python benchmarks/trigger_load.py --acker store     # fake pipelines ack via EpochStore

What runs where:

* a throwaway PostgreSQL server (the epoch store);
* this process: ONE asyncio event loop running N ``CheckpointTrigger.run()`` generators, as the
  triggerer would (store reached through ``ArroyoHook`` and ``AIRFLOW_CONN_ARROYO_DEFAULT``);
* a separate acker process (its CPU does not count): the fake pipelines. ``--acker sql`` (default)
  completes every in-flight epoch with one batched statement every 5 ms, writing the rows
  ``ack_epoch`` would, cheap enough never to be the bottleneck; ``--acker store`` calls
  ``EpochStore.ack_epoch`` once per stage, as pipeline drivers do (slower: epochs overrun their due
  time, which exercises the overdue polling).

What it prints, for the epochs started inside the measurement window (after a warm-up):

* **schedule lateness**: ``triggered_at(n) - (triggered_at(n-1) + interval)``, from the database;
* **controller lateness**: counted from when epoch n could start at all
  (``max(triggered_at(n-1) + interval, ended_at(n-1))``): the trigger's part, not the acker's;
* epochs fired against the schedule's ``N * window / interval`` (a ratio);
* CPU seconds of this (trigger) process per epoch fired (``time.process_time()``: all its threads);
* the store calls per epoch and how long each was awaited (thread-pool queueing included).

``--compare`` runs, in one invocation on one server, the variants below one after the other, each on
fresh pipelines, and prints each against the first:

* ``as shipped``: the trigger as it is;
* ``poll when overdue: off``: without the short doubling polls for an overdue in-flight epoch
  (the trigger before that change: it looked again only after a whole poll interval);
* ``16 store threads``: the event loop's default thread pool (which ``AsyncEpochStore`` uses) and
  the hook's connection pool at 16 instead of Python's ``min(32, CPUs + 4)`` and 8;
* ``ends via get_epoch``: the trigger as it was before ``trigger_tick(watch=...)``: it learnt each
  epoch's end (for its log line) with a ``get_epoch`` transaction of its own.
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
WITH e AS (SELECT pipeline_id, epoch, stages FROM arroyo_epochs WHERE state = 'triggered' FOR UPDATE SKIP LOCKED),
a AS (INSERT INTO arroyo_acks (pipeline_id, epoch, stage, bytes_new, bytes_total)
      SELECT e.pipeline_id, e.epoch, s.stage, 1000, 100000 FROM e CROSS JOIN LATERAL unnest(e.stages) AS s(stage)
      ON CONFLICT DO NOTHING)
UPDATE arroyo_epochs x SET state = 'completed', ended_at = clock_timestamp(),
       bytes_new = 1000 * cardinality(e.stages), bytes_total = 100000 * cardinality(e.stages)
FROM e WHERE x.pipeline_id = e.pipeline_id AND x.epoch = e.epoch AND x.state = 'triggered'
"""


def acker_sql_main(dsn: str, stop: Any, ready: Any, threads: int) -> None:
    """Complete every in-flight epoch of every pipeline in one statement, every 5 ms."""
    import psycopg2

    conn = psycopg2.connect(dsn)
    conn.autocommit = True
    ready.set()
    while not stop.is_set():
        with conn.cursor() as cur:
            cur.execute(ACK_ALL_SQL)
        stop.wait(0.005)
    conn.close()


def acker_store_main(dsn: str, stop: Any, ready: Any, threads: int) -> None:
    """Acknowledge every stage of every in-flight epoch through ``EpochStore.ack_epoch``."""
    import psycopg2

    from airflow_arroyo.exceptions import ArroyoError
    from airflow_arroyo.store import EpochStore

    store = EpochStore(dsn, max_connections=threads + 1)
    scan = psycopg2.connect(dsn)
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
    while not stop.is_set():
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


# --------------------------------------------------------------------------- the triggers (this process)


@dataclass(frozen=True)
class Variant:
    name: str
    threads: int | None = None  # the loop's default thread pool (None: Python's default)
    pool: int = 8  # the hook's connection pool (8 is ArroyoHook's default)
    overdue_polling: bool = True
    ends_in_tick: bool = True  # False: the trigger before TickResult.ended (a get_epoch per ended epoch)


SHIPPED = Variant("as shipped")
VARIANTS = [SHIPPED, Variant("poll when overdue: off", overdue_polling=False),
            Variant("16 store threads", threads=16, pool=16),
            Variant("ends via get_epoch", ends_in_tick=False)]


def setup_pipelines(prefix: str, n: int, dsn: str) -> list[str]:
    from airflow_arroyo.epochs import PipelineState
    from airflow_arroyo.store import EpochStore

    admin = EpochStore(dsn)
    admin.migrate()
    pids = [f"{prefix}-{i:04d}" for i in range(n)]
    for pid in pids:
        admin.register_pipeline(pid, stages=STAGES, run_id="r1")
        admin.set_pipeline_state(pid, PipelineState.RUNNING)
    admin.close()
    return pids


def instrument_store_calls() -> tuple[dict[str, list[float]], Any]:
    """Count and time the triggers' store calls as the event loop awaits them. Returns an undo."""
    from airflow_arroyo.store import AsyncEpochStore

    calls: dict[str, list[float]] = {}
    originals = {}
    for name in ("trigger_tick", "get_epoch", "get_pipeline", "cleanup_lock", "db_now"):
        original = originals[name] = getattr(AsyncEpochStore, name)

        def timed(original: Any = original, name: str = name) -> Any:
            async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                t0 = time.monotonic()
                try:
                    return await original(self, *args, **kwargs)
                finally:
                    calls.setdefault(name, []).append(time.monotonic() - t0)
            return call

        setattr(AsyncEpochStore, name, timed())

    def undo() -> None:
        for name, original in originals.items():
            setattr(AsyncEpochStore, name, original)

    return calls, undo


async def run_triggers(variant: Variant, pids: list[str], interval: float, seconds: float, warmup: float,
                       dsn: str) -> dict[str, Any]:
    from airflow_arroyo.epochs import PipelineState
    from airflow_arroyo.hooks import arroyo as hook_module
    from airflow_arroyo.triggers import checkpoint as trigger_module
    from airflow_arroyo.triggers.checkpoint import CheckpointTrigger

    os.environ["AIRFLOW_CONN_ARROYO_DEFAULT"] = dsn
    hook_module._reset_shared_stores()
    real_shared, real_overdue = hook_module._shared_store, trigger_module.OVERDUE_POLL_MIN

    def shared_store(dsn: str, *, max_connections: int, retry_seconds: float, migrate: bool) -> Any:
        return real_shared(dsn, max_connections=variant.pool, retry_seconds=retry_seconds, migrate=migrate)

    hook_module._shared_store = shared_store
    if not variant.overdue_polling:
        trigger_module.OVERDUE_POLL_MIN = 1e9  # the first overdue look-again: a whole poll
    loop = asyncio.get_running_loop()
    if variant.threads:
        loop.set_default_executor(ThreadPoolExecutor(variant.threads))
    calls, undo = instrument_store_calls()
    admin = hook_module.ArroyoHook().get_store()  # the same process-wide store the triggers use
    if not variant.ends_in_tick:
        from airflow_arroyo.store import AsyncEpochStore

        timed_tick = AsyncEpochStore.trigger_tick

        async def tick_without_watch(self: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs.pop("watch", None)  # ended epochs not reported: the trigger falls back to get_epoch
            return await timed_tick(self, *args, **kwargs)

        AsyncEpochStore.trigger_tick = tick_without_watch  # type: ignore[method-assign]

    async def drive(pid: str) -> dict[str, Any]:
        trigger = CheckpointTrigger(pid, interval=interval, tolerable_failures=1000, triggered_by="bench")
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

    try:
        tasks = [asyncio.create_task(drive(pid)) for pid in pids]
        prober = asyncio.create_task(probe())
        await asyncio.sleep(warmup)
        window_start: datetime = await asyncio.to_thread(admin.db_now)
        cpu0, wall0 = time.process_time(), time.monotonic()
        lag_from = len(loop_lag)
        calls.clear()
        await asyncio.sleep(seconds)
        cpu1, wall1 = time.process_time(), time.monotonic()
        window_calls = {name: list(v) for name, v in calls.items()}
        window_end: datetime = await asyncio.to_thread(admin.db_now)
        lags = loop_lag[lag_from:]
        prober.cancel()

        def stop_all() -> None:
            for pid in pids:
                admin.set_pipeline_state(pid, PipelineState.STOPPED)

        await asyncio.to_thread(stop_all)
        events = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    finally:
        if not variant.ends_in_tick:
            AsyncEpochStore.trigger_tick = timed_tick  # type: ignore[method-assign]
        undo()
        hook_module._shared_store = real_shared
        trigger_module.OVERDUE_POLL_MIN = real_overdue
        hook_module._reset_shared_stores()
    return {"window": (window_start, window_end), "cpu": cpu1 - cpu0, "wall": wall1 - wall0, "events": events,
            "loop_lag": lags, "calls": window_calls}


# --------------------------------------------------------------------------- figures


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def figures(dsn: str, prefix: str, interval: float, window: tuple[datetime, datetime]) -> dict[str, Any]:
    import psycopg2

    params = {"i": interval, "a": window[0], "b": window[1], "p": f"{prefix}-%"}
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(
            "SELECT EXTRACT(EPOCH FROM triggered_at - (prev_start + make_interval(secs => %(i)s))),"
            " EXTRACT(EPOCH FROM triggered_at - GREATEST(prev_start + make_interval(secs => %(i)s), prev_end))"
            " FROM (SELECT triggered_at, lag(triggered_at) OVER w AS prev_start, lag(ended_at) OVER w AS prev_end"
            "       FROM arroyo_epochs WHERE pipeline_id LIKE %(p)s"
            "       WINDOW w AS (PARTITION BY pipeline_id ORDER BY epoch)) e"
            " WHERE prev_start IS NOT NULL AND triggered_at >= %(a)s AND triggered_at < %(b)s",
            params,
        )
        rows = cur.fetchall()
        cur.execute("SELECT state, EXTRACT(EPOCH FROM ended_at - triggered_at) FROM arroyo_epochs"
                    " WHERE pipeline_id LIKE %(p)s AND triggered_at >= %(a)s AND triggered_at < %(b)s", params)
        epochs = cur.fetchall()
    conn.close()
    states: dict[str, int] = {}
    for state, _ in epochs:
        states[state] = states.get(state, 0) + 1
    return {"schedule": [float(r[0]) for r in rows], "controller": [float(r[1]) for r in rows],
            "fired": len(epochs), "states": states,
            "acked": [float(d) for state, d in epochs if state == "completed"]}


def merge(into: dict[str, Any], run: dict[str, Any], f: dict[str, Any], expected: float) -> None:
    """Add one round's figures to a variant's totals."""
    for key in ("schedule", "controller", "acked"):
        into.setdefault(key, []).extend(f[key])
    into["loop_lag"] = into.get("loop_lag", []) + run["loop_lag"]
    for key, value in (("fired", f["fired"]), ("expected", expected), ("cpu", run["cpu"]), ("wall", run["wall"]),
                       ("ok", sum(e["status"] == "success" for e in run["events"])), ("events", len(run["events"]))):
        into[key] = into.get(key, 0) + value
    for state, n in f["states"].items():
        into.setdefault("states", {})[state] = into.get("states", {}).get(state, 0) + n
    for name, durations in run["calls"].items():
        into.setdefault("calls", {}).setdefault(name, []).extend(durations)


def report(variant: Variant, args: argparse.Namespace, t: dict[str, Any]) -> dict[str, float]:
    print(f"[{variant.name}] {args.pipelines} CheckpointTriggers on one event loop, interval {args.interval}s, "
          f"{args.rounds} x {args.seconds:g}s windows after {args.warmup}s warm-up each, {os.cpu_count()} CPUs, "
          f"{args.acker} acker")
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
    print(f"  trigger CPU         {t['cpu']:.2f} s in {t['wall']:.1f} s wall "
          f"({100 * t['cpu'] / t['wall']:.0f}% of one core): {out['cpu_ms']:.2f} ms per epoch fired")
    for name, durations in sorted(t.get("calls", {}).items()):
        ms = [d * 1000 for d in durations]
        print(f"  store.{name:<13} {len(ms) / max(t['fired'], 1):5.2f} calls/epoch   awaited p50 {pct(ms, 50):7.1f} ms"
              f"   p99 {pct(ms, 99):7.1f} ms")
    print(f"  final events        {t['ok']}/{t['events']} success")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipelines", type=int, default=200)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="measurement window per variant")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--acker", choices=["sql", "store"], default="sql")
    parser.add_argument("--acker-threads", type=int, default=4, help="threads of the 'store' acker")
    parser.add_argument("--compare", action="store_true", help="run the variants side by side")
    parser.add_argument("--rounds", type=int, default=None,
                        help="windows per variant, interleaved across variants (default: 1, or 3 with --compare)")
    args = parser.parse_args()

    from airflow_arroyo.devtools.postgres import ThrowawayPostgres

    variants = VARIANTS if args.compare else [SHIPPED]
    args.rounds = args.rounds or (3 if args.compare else 1)
    totals: dict[str, dict[str, Any]] = {v.name: {} for v in variants}
    with ThrowawayPostgres() as pg:
        setup_pipelines("warm", 1, pg.dsn)  # migrate before the acker starts
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        target = acker_sql_main if args.acker == "sql" else acker_store_main
        acker = ctx.Process(target=target, args=(pg.dsn, stop, ready, args.acker_threads), daemon=True)
        acker.start()
        try:
            if not ready.wait(60):
                raise RuntimeError("the acker process did not start")
            # rounds interleave the variants (A B C A B C ...) so that a busy spell of the machine
            # does not land on one variant only
            for rnd in range(args.rounds):
                for i, variant in enumerate(variants):
                    prefix = f"r{rnd}v{i}"
                    pids = setup_pipelines(prefix, args.pipelines, pg.dsn)
                    run = asyncio.run(run_triggers(variant, pids, args.interval, args.seconds, args.warmup, pg.dsn))
                    window_s = (run["window"][1] - run["window"][0]).total_seconds()
                    merge(totals[variant.name], run, figures(pg.dsn, prefix, args.interval, run["window"]),
                          args.pipelines * window_s / args.interval)
        finally:
            stop.set()
            acker.join(30)
            if acker.is_alive():
                acker.terminate()

    summaries = [(v, report(v, args, totals[v.name])) for v in variants]
    if len(summaries) > 1:
        base = summaries[0][1]
        print("side by side (each variant / as shipped; lateness and CPU: lower is better, fired: higher):")
        print(f"  {'variant':<24} {'fired':>7} {'late p50':>9} {'late p99':>9} {'ctrl p50':>9} {'ctrl p99':>9} "
              f"{'CPU/epoch':>9}")
        for variant, s in summaries:
            def r(key: str, s: dict[str, float] = s) -> str:
                return f"{s[key] / base[key]:8.2f}x" if base[key] else "      n/a"
            print(f"  {variant.name:<24} {r('ratio'):>7} {r('schedule_p50'):>9} {r('schedule_p99'):>9} "
                  f"{r('controller_p50'):>9} {r('controller_p99'):>9} {r('cpu_ms'):>9}")


if __name__ == "__main__":
    main()
