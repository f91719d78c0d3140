"""Epochs under sustained backpressure (issue 34, deliverable 3): input arriving faster than the pipeline drains.

One invocation, one SparkSession (local[2]), one throwaway PostgreSQL. The pipeline: the product's generator
(``rows_per_second``: rows become available at a fixed rate whatever the pipeline does) -> a stateful stage that
pays a CPU cost per row (a JVM loop of ``--work`` steps) and counts per key. First a calibration run measures the
fused pipeline's capacity (rows/s with the source always full, read ``--calibration-batch`` rows per batch);
then each side runs **unloaded** (``--unloaded`` x capacity) and **overloaded** (``--overloaded`` x capacity),
one after the other, the sides and loads interleaved and their order reversed every other round. Epochs every
``--interval`` seconds (the benchmark plays the Airflow trigger). Sides:

* ``fused``: source and stage in one query (the default plan); the source reads all it has (no read limit).
* ``fused-limit``: the same with the generator's read limit (``rows_per_batch``) sized so that a batch lasts about
  ``--batch-target`` seconds at the measured capacity.
* ``hop``: a channel between the source stage and the stateful stage (``chain=False``), aligned cuts.
* ``hop-unaligned``: the same with ``PipelineDriver(alignment_timeout=0)`` (a channel stage cuts at its last
  completed batch instead of waiting for the barrier to come through the backlog), when the driver has it.
* ``hop-limit``, ``hop-unaligned-limit`` (only when named in ``--sides``): the hop sides with the source's read
  limit of ``fused-limit``.

Per side and load: epoch duration p50/p99 from the epoch store (ended - triggered, epochs triggered in the
measured window; an epoch still in flight when the window ends counts with its age then, a lower bound, and is
reported), the micro-batches of the query that holds the stateful stage (their duration p50/max and rows p50/max,
from Spark's progress), the rows it processed per second and ``/proc/loadavg``. Then per side the ratio
overloaded p99 / unloaded p99 (issue 34's target: <= 2), median over rounds with every round's value.
Figures measured here are in benchmarks/results/backpressure.md.

    python benchmarks/backpressure.py                         # about 10 minutes
    python benchmarks/backpressure.py --rounds 3 --sides fused fused-limit
"""

from __future__ import annotations

import argparse
import calendar
import inspect
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import DrivenPipeline, local_session_builder, product_confs

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime import Pipeline
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import generator_source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SIDES = ("fused", "fused-limit", "hop", "hop-unaligned")
EXTRA_SIDES = ("hop-limit", "hop-unaligned-limit")  # the hop sides with the source's read limit, on request
HAS_ALIGNMENT_TIMEOUT = "alignment_timeout" in inspect.signature(PipelineDriver.__init__).parameters


def costly_count(df: DataFrame, work: int) -> DataFrame:
    """The stateful stage: a CPU cost per row (a JVM loop of ``work`` steps over the row's value), then a count and a
    sum per key (``update`` mode)."""
    from pyspark.sql import functions as F

    spin = F.expr(f"aggregate(sequence(1, {work}), value, (acc, x) -> (acc * 31 + x) % 1000003)")
    return df.withColumn("spin", spin).groupBy("key").agg(F.count("*").alias("n"), F.sum("spin").alias("spin"))


def pipeline(pid: str, *, rate: int | None, limit: int | None, work: int, hop: bool) -> Pipeline:
    """The generator at ``rate`` rows/s (None: always full) with read limit ``limit`` -> the costly count; ``hop``:
    a channel between them."""
    p = Pipeline(pid)

    def read(spark: SparkSession) -> DataFrame:
        return generator_source(spark, seed=1, keys=64, rows_per_second=rate, rows_per_batch=limit)

    src = p.source("src", read)
    p.stage("count", lambda df: costly_count(df, work), inputs=[src], output_mode="update", chain=not hop)
    return p


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank); NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


@dataclass
class Run:
    side: str
    load: str  # "unloaded" / "overloaded" / "calibration"
    round: int
    rate: int | None
    limit: int | None
    epochs: list[float] = field(default_factory=list)  # durations (s), in-flight ones at their age
    in_flight: int = 0
    batch_s: list[float] = field(default_factory=list)  # the stateful query's micro-batches in the window
    batch_rows: list[int] = field(default_factory=list)
    processed_per_s: float = 0.0
    load_before: str = ""
    load_after: str = ""

    @property
    def p50(self) -> float:
        return quantile(self.epochs, 0.5)

    @property
    def p99(self) -> float:
        return quantile(self.epochs, 0.99)

    def line(self) -> str:
        rate = "full" if self.rate is None else f"{self.rate}/s"
        rows_p50 = quantile([float(r) for r in self.batch_rows], 0.5)
        return (f"  round {self.round} {self.side:13s} {self.load:10s} rate {rate:>9s} limit {self.limit or '-'!s:>7}: "
                f"{len(self.epochs):3d} epochs ({self.in_flight} in flight), p50 {self.p50:6.2f} s, "
                f"p99 {self.p99:6.2f} s; batches {len(self.batch_s)}, s p50 {quantile(self.batch_s, 0.5):5.2f} max "
                f"{max(self.batch_s, default=float('nan')):5.2f}, rows p50 {rows_p50:8.0f}"
                f" max {max(self.batch_rows, default=0):8d}; {self.processed_per_s:7.0f} rows/s; "
                f"load {self.load_before} -> {self.load_after}")


def stateful_query_progress(driver: PipelineDriver, since: float) -> list[dict[str, Any]]:
    """The progress of the micro-batches with rows of the query holding the stateful stage that started at or after
    wall time ``since`` (the last stage of the physical plan)."""
    runner = driver.runners[-1]
    query = runner.query
    if query is None:
        return []
    out = []
    for p in query.recentProgress:
        got = json.loads(p.json)
        started = calendar.timegm(time.strptime(got["timestamp"][:19], "%Y-%m-%dT%H:%M:%S"))  # UTC
        if started >= since and got.get("numInputRows", 0) > 0:
            out.append(got)
    return out


def run_side(spark: SparkSession, store: EpochStore, tmp: Path, run: Run, *, work: int, interval: float,
             warmup: float, duration: float) -> Run:
    hop = run.side.startswith("hop")
    pid = f"bp-{run.side}-{run.load[:4]}-{uuid.uuid4().hex[:6]}"
    extra: dict[str, Any] = {"alignment_timeout": 0.0} if run.side.startswith("hop-unaligned") else {}
    driver = PipelineDriver(pipeline(pid, rate=run.rate, limit=run.limit, work=work, hop=hop), store,
                            storage_uri=str(tmp / pid), spark=spark, **extra)
    run_driver = driver.run

    def run_and_signal() -> Any:  # a driver that fails before it started ends DrivenPipeline's wait at once
        try:
            return run_driver()
        finally:
            driver.started.set()

    driver.run = run_and_signal  # type: ignore[method-assign]
    run.load_before = loadavg()
    driven = DrivenPipeline(driver, store, interval if run.load != "calibration" else 3600.0)
    try:
        time.sleep(warmup)
        wall = time.time()
        time.sleep(duration)
        end = time.time()
        progress = stateful_query_progress(driver, wall)
        epochs = [e for e in store.list_epochs(pid, limit=10_000) if e.triggered_at.timestamp() >= wall
                  and e.triggered_at.timestamp() < end]
    finally:
        driven.stop()
    run.load_after = loadavg()
    for e in epochs:
        if e.ended_at is None or e.ended_at.timestamp() > end:  # in flight at the window's end: its age then
            run.epochs.append(end - e.triggered_at.timestamp())
            run.in_flight += 1
        else:  # completed (or failed, expired: as long as it lasted)
            run.epochs.append((e.ended_at - e.triggered_at).total_seconds())
    run.batch_s = [p["durationMs"]["triggerExecution"] / 1000 for p in progress]
    run.batch_rows = [int(p["numInputRows"]) for p in progress]
    run.processed_per_s = sum(run.batch_rows) / duration
    print(run.line(), flush=True)
    return run


def summarize(runs: list[Run], sides: list[str]) -> list[dict[str, Any]]:
    print("\nepoch duration p99, overloaded / unloaded, per side (median over rounds; every round's in brackets):")
    out = []
    for side in sides:
        ratios = []
        for r in sorted({r.round for r in runs}):
            lo = [x for x in runs if x.side == side and x.round == r and x.load == "unloaded"]
            hi = [x for x in runs if x.side == side and x.round == r and x.load == "overloaded"]
            if lo and hi and lo[0].p99 > 0:
                ratios.append(hi[0].p99 / lo[0].p99)

        def med(load: str, attr: str, side: str = side) -> float:
            got = [getattr(x, attr) for x in runs if x.side == side and x.load == load]
            return float(statistics.median(got)) if got else float("nan")

        row = {"side": side, "ratio_p99": statistics.median(ratios) if ratios else float("nan"),
               "ratios": ratios, "unloaded_p50": med("unloaded", "p50"), "unloaded_p99": med("unloaded", "p99"),
               "overloaded_p50": med("overloaded", "p50"), "overloaded_p99": med("overloaded", "p99")}
        out.append(row)
        print(f"  {side:13s}: unloaded p50 {row['unloaded_p50']:6.2f} s p99 {row['unloaded_p99']:6.2f} s | overloaded "
              f"p50 {row['overloaded_p50']:6.2f} s p99 {row['overloaded_p99']:6.2f} s | ratio p99 "
              f"{row['ratio_p99']:5.2f}x [{', '.join(f'{x:.2f}' for x in ratios)}]", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", nargs="+", choices=SIDES + EXTRA_SIDES, default=list(SIDES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--work", type=int, default=200, help="steps of the per-row JVM loop (the cost per row)")
    parser.add_argument("--capacity", type=int, default=None,
                        help="rows/s the fused pipeline drains (default: measured by a calibration run first)")
    parser.add_argument("--calibration-batch", type=int, default=20_000)
    parser.add_argument("--unloaded", type=float, default=0.3, help="input rate as a fraction of capacity")
    parser.add_argument("--overloaded", type=float, default=1.7, help="input rate as a multiple of capacity")
    parser.add_argument("--batch-target", type=float, default=0.5,
                        help="fused-limit: the read limit is capacity x this many seconds")
    parser.add_argument("--interval", type=float, default=1.5, help="seconds between epochs")
    parser.add_argument("--warmup", type=float, default=8.0)
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    sides = [s for s in args.sides if not s.startswith("hop-unaligned") or HAS_ALIGNMENT_TIMEOUT]
    if len(sides) < len(args.sides):
        print("PipelineDriver has no alignment_timeout here: hop-unaligned left out", flush=True)

    runs: list[Run] = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-backpressure-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        spark = local_session_builder("arroyo-backpressure", confs=product_confs({})).getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        try:
            print(f"local[2], work {args.work}, epochs every {args.interval:g} s, warm-up {args.warmup:g} s, "
                  f"{args.duration:g} s measured, {args.rounds} round(s); load {loadavg()}", flush=True)
            capacity = args.capacity
            if capacity is None:
                cal = run_side(spark, store, Path(tmp), Run("fused", "calibration", 0, None, args.calibration_batch),
                               work=args.work, interval=args.interval, warmup=args.warmup, duration=args.duration)
                capacity = int(sum(cal.batch_rows) / sum(cal.batch_s)) if cal.batch_s else 0
                if capacity <= 0:
                    raise SystemExit("the calibration run processed no rows; give it longer with --warmup")
            limit = max(1, int(capacity * args.batch_target))
            print(f"capacity {capacity} rows/s; unloaded {int(capacity * args.unloaded)} rows/s, overloaded "
                  f"{int(capacity * args.overloaded)} rows/s; fused-limit reads at most {limit} rows a batch",
                  flush=True)
            for i in range(args.rounds):
                order = [(s, load) for s in sides for load in ("unloaded", "overloaded")]
                for side, load in order if i % 2 == 0 else order[::-1]:
                    rate = int(capacity * (args.unloaded if load == "unloaded" else args.overloaded))
                    try:
                        runs.append(run_side(spark, store, Path(tmp),
                                             Run(side, load, i, rate, limit if side.endswith("-limit") else None),
                                             work=args.work, interval=args.interval, warmup=args.warmup,
                                             duration=args.duration))
                    except SystemExit as exc:  # one failed start (a busy machine) leaves the other runs' figures
                        print(f"  round {i} {side} {load}: the run failed, left out: {exc}", flush=True)
        finally:
            spark.stop()
            store.close()
    summary = summarize(runs, sides)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "ratios": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
