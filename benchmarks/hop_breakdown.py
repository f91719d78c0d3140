"""Where a channel hop's time goes: an instrumented run of the latency benchmark's pipeline, unfused.

Runs ``benchmarks/latency.py``'s pipeline (two ``rate`` sources, a stream-stream join, a filter, a
``foreach_batch`` sink) with ``Pipeline(chaining=False)`` (one query per stage, a channel per edge) in this
process, with an epoch every ``--interval`` seconds, and times, in the driver process:

* each stage's ``foreachBatch`` writer and its parts (waiting for readers, the channel append and its
  steps: the replay check, the schema check, ``df.toArrow()`` (the Spark job that runs the batch, the
  reader's Python read tasks included), the Parquet write, the entry commit; then the stage's cut logic:
  reading ``offsets/b``, the caps);
* Spark's own phases of every micro-batch, from the queries' progress (``durationMs``: ``latestOffset``,
  ``walCommit`` = the offsets log, ``queryPlanning``, ``addBatch`` = the ``foreachBatch``, ``commitOffsets``
  = the commits log, ``triggerExecution`` = the whole batch);
* per channel, for every data entry: how long after its commit the reading query's batch that read it
  started (split into "the reader was busy in a batch" and "the reader was idle until its next trigger"),
  and how long that batch then took until it had appended its own output (or, for the sink, ended).

``--boundary`` runs the benchmark's boundary form instead (the pipeline fused, one channel left before the
sink: two queries). Also prints the processes the machine started per second (``/proc/stat``: Hadoop's
``chmod`` processes show there; ``--hadoop-local-fs`` runs without the provider's ``file:`` file system). The
session starts as the driver starts a local one (``airflow_arroyo.jvm.local_master_conf``); ``--conf`` values win.

Prints medians. ``python benchmarks/hop_breakdown.py --rate 2000 --warmup 15 --duration 30``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow.parquet as pq
from _spark import conf_pair, descendants, local_session_builder, processes, product_confs
from latency import Product

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime import channel as channel_mod
from airflow_arroyo.runtime import stage as stage_mod
from airflow_arroyo.runtime.channel import Channel, EntryKind
from airflow_arroyo.runtime.stage import StageRunner
from airflow_arroyo.store import EpochStore

_current = threading.local()
_times: dict[tuple[str, str], list[float]] = defaultdict(list)
_lock = threading.Lock()


def _record(step: str, ms: float) -> None:
    stage = getattr(_current, "stage", "-")
    with _lock:
        _times[(stage, step)].append(ms)


def _timed(owner: Any, attr: str, step: str, *, sets_stage: bool = False) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if sets_stage:
            _current.stage = args[0].name
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            _record(step, (time.perf_counter() - t0) * 1000)

    setattr(owner, attr, wrapper)


def instrument() -> None:
    from pyspark.sql.classic.dataframe import DataFrame

    _timed(StageRunner, "_foreach_batch", "foreachBatch (whole)", sets_stage=True)
    _timed(StageRunner, "_wait_for_readers", "  wait for readers (flow control)")
    _timed(StageRunner, "_write", "  write (append or sink)")
    _timed(Channel, "last_batch_id", "    replay check (last_batch_id)")
    _timed(Channel, "_ensure_schema", "    schema check")
    _timed(channel_mod, "normalize_schema", "    normalize df.schema")
    _timed(DataFrame, "toArrow", "    df.toArrow() (the batch's Spark job)")
    _timed(pq, "write_table", "    Parquet write")
    _timed(Channel, "_append_with_spark", "    executors' write (first batch, large ones)")
    _timed(Channel, "_commit_data", "    commit (count rows, sizes, entry)")
    _timed(Channel, "_append_entry", "      log entry (fence check, end, exclusive create)")
    _timed(StageRunner, "_channel_cut", "  cut logic (channel stage)")
    _timed(StageRunner, "_source_cut", "  cut logic (source stage)")
    _timed(stage_mod, "checkpoint_offsets", "    read offsets/b")
    _timed(StageRunner, "_write_caps", "    caps")


def ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _offset(raw: Any) -> dict[str, Any] | None:
    value = json.loads(raw) if isinstance(raw, str) else raw
    return value if isinstance(value, dict) else None


def med(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f}" if values else "      -"


STEPS = ["foreachBatch (whole)", "  wait for readers (flow control)", "  write (append or sink)",
         "    replay check (last_batch_id)", "    normalize df.schema", "    schema check",
         "    df.toArrow() (the batch's Spark job)", "    executors' write (first batch, large ones)",
         "    Parquet write", "    commit (count rows, sizes, entry)",
         "      log entry (fence check, end, exclusive create)", "  cut logic (source stage)",
         "  cut logic (channel stage)", "    read offsets/b", "    caps"]


def analyse(product: Product, since: float) -> None:
    runners = {r.name: r for r in product.driver.runners}
    progress: dict[str, list[dict[str, Any]]] = {}
    for name, r in runners.items():
        assert r.query is not None
        progress[name] = [json.loads(p.json) for p in r.query.recentProgress]
    stages = list(runners)
    print_writer_steps(stages)
    print_spark_phases(stages, progress, since)
    print_hops(runners, progress, since)


def print_writer_steps(stages: list[str]) -> None:
    print("\nforeachBatch in the driver, ms per micro-batch with rows (median; n):")
    steps = STEPS
    print(f"  {'step':58s}" + "".join(f"{s[:10]:>12s}" for s in stages))
    for step in steps:
        row = [_times.get((s, step), []) for s in stages]
        if not any(row):
            continue
        print(f"  {step:58s}" + "".join(f"{med(v)} ({len(v):3d})" for v in row))



def print_spark_phases(stages: list[str], progress: dict[str, list[dict[str, Any]]], since: float) -> None:
    print("\nSpark's phases per micro-batch that ran (progress durationMs, median over the window):")
    phases = ["latestOffset", "walCommit", "queryPlanning", "getBatch", "addBatch", "commitOffsets",
              "triggerExecution"]
    print(f"  {'phase':18s}" + "".join(f"{s[:10]:>12s}" for s in stages))
    ran = {s: [p for p in progress[s] if ts(p["timestamp"]) >= since and "addBatch" in p["durationMs"]]
           for s in stages}
    for phase in phases:
        print(f"  {phase:18s}" + "".join(f"{med([p['durationMs'].get(phase, 0) for p in ran[s]]):>12s}"
                                            for s in stages))
    print(f"  {'batches':18s}" + "".join(f"{len(ran[s]):>12d}" for s in stages))
    print(f"  {'rows per batch':18s}" + "".join(f"{med([p['numInputRows'] for p in ran[s]]):>12s}" for s in stages))
    idle = {s: [p for p in progress[s] if ts(p["timestamp"]) >= since and "addBatch" not in p["durationMs"]]
            for s in stages}
    print(f"  {'idle triggers':18s}" + "".join(f"{len(idle[s]):>12d}" for s in stages))
    print(f"  {'idle latestOffset':18s}" + "".join(
        f"{med([p['durationMs'].get('latestOffset', 0) for p in idle[s]]):>12s}" for s in stages))



def reader_batches(progress: list[dict[str, Any]], channel: str) -> list[tuple[int, int, dict[str, Any]]]:
    """The reader's batches that ran, as (start position, end position on ``channel``, progress), in time order."""
    out = []
    for p in progress:
        if "addBatch" not in p["durationMs"]:
            continue
        for src in p["sources"]:
            start, end = _offset(src.get("startOffset")), _offset(src.get("endOffset"))
            if end and end.get("key") == channel:
                out.append((int(start["pos"]) if start else 0, int(end["pos"]), p))
    return sorted(out, key=lambda x: ts(x[2]["timestamp"]))


def print_hops(runners: dict[str, StageRunner], progress: dict[str, list[dict[str, Any]]], since: float) -> None:
    """Per channel: entry commit -> the reader's batch that read it."""
    stages = list(runners)
    print("\nper channel hop, ms (median over data entries committed in the window):")
    print(f"  {'channel':10s} {'reader':10s} {'n':>4s} {'wait':>7s} {'busy':>7s} {'idle':>7s} "
          f"{'r.lOff':>7s} {'r.batch->out':>12s} {'w.batch->commit':>15s}")
    for writer in stages:
        out = runners[writer].output
        if out is None:
            continue
        channel = runners[writer].spec.output
        assert channel is not None
        readers = [s for s in stages if channel in runners[s].spec.inputs]
        entries = [e for e in out.entries(out.start_position())
                   if e.kind is EntryKind.DATA and e.time is not None and e.time >= since]
        wbatches = {p["batchId"]: p for p in progress[writer]}
        for reader in readers:
            rb = reader_batches(progress[reader], channel)
            # the reader's output: entry times of its own channel by batch id
            r_out = runners[reader].output
            r_commit: dict[int, float] = {}
            if r_out is not None:
                for e in r_out.entries(r_out.start_position()):
                    if e.kind is EntryKind.DATA and e.batch_id is not None and e.time is not None:
                        r_commit[e.batch_id] = e.time
            waits: list[float] = []
            busy: list[float] = []
            idle_w: list[float] = []
            lat_off: list[float] = []
            to_out: list[float] = []
            w_commit: list[float] = []
            for e in entries:
                assert e.time is not None
                hit = next((i for i, (s, t, _) in enumerate(rb) if s <= e.index < t), None)
                if hit is None:
                    continue
                p = rb[hit][2]
                start = ts(p["timestamp"])
                prev_end = (ts(rb[hit - 1][2]["timestamp"]) + rb[hit - 1][2]["durationMs"]["triggerExecution"] / 1000
                            if hit > 0 else start)
                waits.append((start - e.time) * 1000)
                b = max(0.0, min(prev_end, start) - e.time)
                busy.append(b * 1000)
                idle_w.append(max(0.0, start - max(prev_end, e.time)) * 1000)
                lat_off.append(p["durationMs"].get("latestOffset", 0))
                done = r_commit.get(p["batchId"])
                to_out.append(((done if done is not None else start + p["durationMs"]["triggerExecution"] / 1000)
                               - start) * 1000)
                wp = wbatches.get(e.batch_id)
                if wp is not None:
                    w_commit.append((e.time - ts(wp["timestamp"])) * 1000)
            print(f"  {channel:10s} {reader:10s} {len(waits):4d} {med(waits)} {med(busy)} {med(idle_w)} "
                  f"{med(lat_off)} {med(to_out):>12s} {med(w_commit):>15s}")
    print("  wait = reader batch start - entry commit (busy: the reader was still in its previous batch; idle: "
          "waiting for its next trigger); r.lOff = the reader's latestOffset phase; r.batch->out = reader batch "
          "start -> its own output entry committed (sink: batch end); w.batch->commit = the writer's batch start "
          "-> this entry committed. Progress timestamps have ms resolution.")


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process and its live descendants (the driver JVM, Python workers)."""
    procs = processes()
    me = os.getpid()
    return sum(procs[p].own for p in {me} | descendants(procs, me) if p in procs)


def processes_started() -> int:
    """Processes started on the machine since boot (``/proc/stat``): the JVM's ``chmod`` processes show here."""
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("processes "))


def cpu_percent(since: tuple[float, float]) -> float:
    """CPU used by this run's processes since ``since`` (wall, CPU seconds), as a share of one core."""
    wall, cpu = since
    return 100 * (tree_cpu_seconds() - cpu) / (time.monotonic() - wall)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2000, help="rows/s per source")
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between epochs")
    parser.add_argument("--conf", action="append", default=[], type=conf_pair, help="extra Spark conf k=v")
    parser.add_argument("--trigger-interval", type=float, default=None,
                        help="seconds between micro-batch starts of every stage (default: the stages' defaults, "
                             f"{stage_mod.DEFAULT_TRIGGER_INTERVAL:g} s reading Spark sources, "
                             f"{stage_mod.DEFAULT_CHANNEL_TRIGGER_INTERVAL:g} s reading channels; 0 = as fast as "
                             "possible)")
    parser.add_argument("--boundary", action="store_true",
                        help="the latency benchmark's boundary form instead: the pipeline fused, one channel left "
                             "before the sink (two queries)")
    parser.add_argument("--hadoop-local-fs", action="store_true",
                        help="Hadoop's own file: file system (chmod processes) instead of the provider's, "
                             "as before airflow_arroyo.jvm")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    confs = product_confs({"spark.sql.streaming.numRecentProgressUpdates": "2000", **dict(args.conf)},
                          hadoop_local_fs=args.hadoop_local_fs)  # as the driver builds a local session
    spark = local_session_builder("arroyo-hop-breakdown", confs=confs).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    instrument()
    if args.trigger_interval is not None:
        stage_mod.DEFAULT_TRIGGER_INTERVAL = stage_mod.DEFAULT_CHANNEL_TRIGGER_INTERVAL = args.trigger_interval
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-hops-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        product = Product(spark, store, args.rate, Path(tmp), args.interval, chaining=args.boundary,
                          boundary=args.boundary)
        try:
            time.sleep(args.warmup)
            with _lock:
                _times.clear()
            since = time.time()
            start = time.monotonic()
            cpu0 = (time.monotonic(), tree_cpu_seconds())
            forks0 = processes_started()
            time.sleep(args.duration)
            forks = (processes_started() - forks0) / args.duration
            rows, hist, delivered = product.recorder.window(start, time.monotonic())
            from latency import percentile

            print(f"{'boundary' if args.boundary else 'unfused'}, rate {args.rate}/s per source, {args.duration:g} s "
                  f"measured: {rows / args.duration:.0f} rows/s, latency at the sink's call p50 "
                  f"{percentile(hist, 0.5):.2f} s, p99 {percentile(hist, 0.99):.2f} s, delivered p50 "
                  f"{percentile(delivered, 0.5):.2f} s; "
                  f"load average {os.getloadavg()[0]:.1f}; this run's processes used {cpu_percent(cpu0):.0f} % "
                  f"of one core; processes started on the machine: {forks:.0f} a second")
            analyse(product, since)
        finally:
            product.stop()
            store.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
