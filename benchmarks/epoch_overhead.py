"""What do checkpoint epochs cost? The demo pipeline with epochs every 10 s and without, side by side.

One invocation, one SparkSession (local[2]), one throwaway PostgreSQL. The demo pipeline
(two unbounded generators -> stream-stream join -> filter) runs once without epochs and once with an
epoch every ``--interval`` seconds (the benchmark plays the Airflow trigger: ``trigger_tick`` every
0.5 s), in alternating order over ``--rounds`` rounds. Each run warms up, then counts the rows that
reach the final channel over ``--duration`` seconds. Prints throughput of both (records/s), their
ratio (target >= 0.95), epoch duration p50/p95 and bytes new/total per epoch.

    python benchmarks/epoch_overhead.py                 # about 3 minutes
    python benchmarks/epoch_overhead.py --long          # 3 rounds of 3 minutes each
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.epochs import CheckpointPolicy, EpochState
from airflow_arroyo.examples import OUTPUT_CHANNEL, demo
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.store import EpochStore


@dataclass
class RunResult:
    name: str
    epochs: bool
    rows: int
    seconds: float
    source_rows: int
    epoch_durations: list[float] = field(default_factory=list)
    bytes_new: list[int] = field(default_factory=list)
    bytes_total: list[int] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.rows / self.seconds if self.seconds else 0.0


def channel_rows(ch: Channel) -> int:
    return sum(e.rows for e in ch.data_entries(ch.start_position(), ch.end_position()))


def run_once(spark: Any, store: EpochStore, storage: Path, *, epochs: bool, interval: float, warmup: float,
             duration: float, rows_per_batch: int) -> RunResult:
    name = "epochs" if epochs else "no-epochs"
    pid = f"bench-{name}-{uuid.uuid4().hex[:6]}"
    pipeline = demo(pid, rows=None, rows_per_batch=rows_per_batch)
    driver = PipelineDriver(pipeline, store, storage_uri=str(storage), spark=spark)
    failure: list[BaseException] = []

    def drive() -> None:
        try:
            driver.run()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failure.append(exc)

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    if not driver.started.wait(600) or failure:
        raise SystemExit(f"{name}: the pipeline did not start: {failure}")
    stop = threading.Event()

    def control() -> None:
        policy = CheckpointPolicy(interval=interval, timeout=max(60.0, 6 * interval))
        while not stop.wait(0.5):
            store.trigger_tick(pid, policy, triggered_by="benchmark")

    controller = threading.Thread(target=control, daemon=True)
    if epochs:
        controller.start()
    report = Channel.open(driver.layout.channel_uri(OUTPUT_CHANNEL))
    left = Channel.open(driver.layout.channel_uri("left"))
    time.sleep(warmup)
    t0, r0, s0 = time.monotonic(), channel_rows(report), channel_rows(left)
    first_epoch = store.get_pipeline(pid).last_epoch
    time.sleep(duration)
    t1, r1, s1 = time.monotonic(), channel_rows(report), channel_rows(left)
    stop.set()
    if epochs:
        controller.join()
    store.request_stop(pid, "immediate")
    thread.join(300)
    if failure:
        raise SystemExit(f"{name}: the pipeline failed: {failure[0]}")
    result = RunResult(name, epochs, r1 - r0, t1 - t0, s1 - s0)
    for e in store.list_epochs(pid, limit=10_000):
        if e.epoch > first_epoch and e.state is EpochState.COMPLETED and e.duration_s is not None:
            result.epoch_durations.append(e.duration_s)
            result.bytes_new.append(int(e.bytes_new or 0))
            result.bytes_total.append(int(e.bytes_total or 0))
    print(f"  {name:10s} {result.throughput:10.0f} records/s  ({result.rows} rows in {result.seconds:.0f}s; "
          f"{len(result.epoch_durations)} epochs completed)", flush=True)
    return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between epochs (default 10)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds per run (default 60)")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring (default 15)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (no-epochs, epochs) runs (default 1)")
    parser.add_argument("--rows-per-batch", type=int, default=5000, help="generator rows per micro-batch")
    parser.add_argument("--long", action="store_true", help="3 rounds of 180 s runs")
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args(argv)
    if args.long:
        args.rounds, args.duration = 3, 180.0
    logging.basicConfig(level=logging.WARNING)

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("arroyo-epoch-overhead")
             .config("spark.sql.shuffle.partitions", "2").config("spark.default.parallelism", "2")
             .config("spark.ui.enabled", "false").config("spark.driver.memory", "2g").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    results: list[RunResult] = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-bench-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        print(f"demo pipeline, local[2], epochs every {args.interval:g}s, {args.duration:g}s measured per run, "
              f"{args.rounds} round(s)", flush=True)
        for r in range(args.rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            for with_epochs in order:
                results.append(run_once(spark, store, Path(tmp) / f"r{r}-{int(with_epochs)}", epochs=with_epochs,
                                        interval=args.interval, warmup=args.warmup, duration=args.duration,
                                        rows_per_batch=args.rows_per_batch))
        store.close()
    spark.stop()

    base = [r for r in results if not r.epochs]
    with_e = [r for r in results if r.epochs]
    tp_base = statistics.median(r.throughput for r in base)
    tp_e = statistics.median(r.throughput for r in with_e)
    durations = [d for r in with_e for d in r.epoch_durations]
    new = [b for r in with_e for b in r.bytes_new]
    total = [b for r in with_e for b in r.bytes_total]
    ratio = tp_e / tp_base if tp_base else float("nan")
    print()
    print(f"{'':28s}{'without epochs':>16s}{'with epochs':>16s}")
    print(f"{'throughput (records/s)':28s}{tp_base:16.0f}{tp_e:16.0f}")
    print(f"ratio with/without          {ratio:.3f}   (target >= 0.95)")
    print(f"epochs completed            {len(durations)}")
    print(f"epoch duration p50 / p95    {percentile(durations, 0.5):.2f} s / {percentile(durations, 0.95):.2f} s")
    if new:
        fractions = [n / t for n, t in zip(new, total, strict=True) if t]
        print(f"bytes new / total per epoch median {statistics.median(new):,.0f} / {statistics.median(total):,.0f} "
              f"(new = {100 * statistics.median(fractions):.1f}% of total; last epoch {new[-1]:,} / {total[-1]:,})")
    if args.json:
        print(json.dumps({"throughput_without": tp_base, "throughput_with": tp_e, "ratio": ratio,
                          "epoch_p50_s": percentile(durations, 0.5), "epoch_p95_s": percentile(durations, 0.95),
                          "bytes_new": new, "bytes_total": total,
                          "runs": [r.__dict__ for r in results]}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
