"""CPU per row at a steady rate and at capacity: the fused pipeline against ONE plain query of the same logic.

The logic is the demo's shape with bounded state (``soak.py``'s): two generator sources (the package's Python
data source, ``airflow_arroyo.testing.generator_source``, 2 partitions each), a stream-stream join on ``id``
within 2 s of event time under 5 s watermarks, a filter, and a ``foreach_batch`` sink that records the event ->
sink latency of every row (``latency.py``'s recorder).

* **steady** (``--rate`` rows/s per source, a divisor of 1000): the generators are paced on the wall clock; a
  row's ``ts`` is the wall time it became readable, so "event -> sink" is from then until the sink's call.
* **capacity** (``--capacity-batch`` rows per source per micro-batch, unpaced): as fast as the machine runs it;
  throughput is rows reaching the sink per second.

Sides, each in a process of its own (a fresh driver JVM), alternating (forward, then reversed, per round):

* **plain**: one Structured Streaming query, default trigger, Spark's default settings (as ``latency.py``'s);
* **fused**: the same logic as an airflow-arroyo ``Pipeline`` fused into one query by the graph, run by the
  driver on a session with the provider's confs, an epoch every ``--interval`` seconds (the benchmark plays the
  Airflow trigger); ``--fused-triggers T ...`` adds fused sides whose stages all set ``trigger_interval=T``
  (``fused@T``: the cadence against the default's).

Each side runs with the change under test on (``after``) and off (``before``: ``ARROYO_FREEZE_WORKER_HEAP=false``
in the environment the JVM and its Python workers start with, Spark's own behaviour of the workers' garbage
collector; ``--versions after`` leaves it out). Measured over ``--duration`` seconds after ``--warmup``:
CPU seconds of the run's processes (this process: the driver loop and ``foreachBatch`` callbacks; the JVM;
Spark's Python workers and source runners) per 1,000 rows reaching the sink, micro-batches run, rows/s,
latency p50 at the sink's call and delivered (``latency.py``). Prints each run, then per mode and version
the medians and the fused / plain ratios with each round's own ratio (the spread). The load average is printed
at each run's start.

    python benchmarks/steady_cpu.py                                   # 2 rounds: about 15 minutes
    python benchmarks/steady_cpu.py --modes steady --rounds 3 --versions after --fused-triggers 0.5
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _spark import (
    DrivenPipeline,
    conf_pair,
    descendants,
    local_session_builder,
    processes,
    product_confs,
    run_in_process,
)
from latency import Recorder, percentile

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sources import FREEZE_WORKER_HEAP_ENV, register_data_source
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import GeneratorDataSource, GeneratorOptions, GeneratorStreamReader, generator_source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.streaming import StreamingQuery

BASE_S = 1_704_067_200  # the generator's ts of id 0 (2024-01-01T00:00:00Z)


# ------------------------------------------------------------------------------------------ the source


class WallClockReader(GeneratorStreamReader):
    """The generator paced on the wall clock: id ``i`` becomes readable at ``BASE_S + i / rate``, which is its
    ``ts`` when ``ms_per_row = 1000 / rate``: event time is the time the row could first be read."""

    def _available(self, begin: int) -> int | None:  # noqa: ARG002 - the generator's signature
        assert self.options.rows_per_second is not None
        return int((time.time() - BASE_S) * self.options.rows_per_second)


class WallClockGenerator(GeneratorDataSource):
    @classmethod
    def name(cls) -> str:
        return "arroyo_wallclock_generator"

    def streamReader(self, schema: Any) -> WallClockReader:  # noqa: ARG002 - Spark's signature
        return WallClockReader(GeneratorOptions.parse(dict(self.options)))


def read_source(spark: SparkSession, seed: int, mode: str, rate: int, batch: int) -> DataFrame:
    if mode == "capacity":
        return generator_source(spark, seed=seed, keys=100, rows_per_batch=batch, ms_per_row=1)
    register_data_source(spark, WallClockGenerator)
    start = int((time.time() - BASE_S) * rate)  # from now on, not from 2024
    reader = spark.readStream.format(WallClockGenerator.name())
    for k, v in {"seed": seed, "keys": 100, "start": start, "rows_per_second": rate,
                 "ms_per_row": 1000 // rate}.items():
        reader = reader.option(k, str(v))
    return reader.load()


# ------------------------------------------------------------------------------------------ the logic, once


def left(df: DataFrame) -> DataFrame:
    return df


def right(df: DataFrame) -> DataFrame:
    return df.selectExpr("id AS rid", "value AS right_value", "ts AS rts")


def join(lhs: DataFrame, rhs: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    lhs, rhs = lhs.withWatermark("ts", "5 seconds"), rhs.withWatermark("rts", "5 seconds")
    cond = F.expr("id = rid AND rts BETWEEN ts - INTERVAL 2 SECONDS AND ts + INTERVAL 2 SECONDS")
    return lhs.join(rhs, cond).selectExpr("id", "key", "ts", "value AS left_value", "right_value")


def report(joined: DataFrame) -> DataFrame:
    return joined.where("(left_value + right_value) % 7 <> 0")


# ------------------------------------------------------------------------------------------ the two sides


class Plain:
    def __init__(self, spark: SparkSession, mode: str, rate: int, batch: int, tmp: Path) -> None:
        self.recorder = Recorder()
        lhs = left(read_source(spark, 1, mode, rate, batch))
        rhs = right(read_source(spark, 2, mode, rate, batch))
        self.query = (report(join(lhs, rhs)).writeStream.foreachBatch(self.recorder)
                      .option("checkpointLocation", str(tmp / f"plain-{uuid.uuid4().hex[:6]}")).start())
        # as the driver warms its queries up before it runs (its first batch pays for the Python workers, the
        # state stores and code generation): the warm-up then starts from a query that ran, on both sides
        deadline = time.monotonic() + 600
        while self.query.lastProgress is None and time.monotonic() < deadline:
            if self.query.exception() is not None:
                raise SystemExit(f"the plain query failed: {self.query.exception()}")
            time.sleep(0.1)

    def queries(self) -> list[StreamingQuery]:
        return [self.query]

    def stop(self) -> None:
        error = self.query.exception()
        self.query.stop()
        if error is not None:
            raise SystemExit(f"the plain query failed: {error}")


class Fused(DrivenPipeline):
    def __init__(self, spark: SparkSession, store: EpochStore, mode: str, rate: int, batch: int, tmp: Path,
                 interval: float, trigger: float | None = None) -> None:
        self.recorder = Recorder()
        pid = f"steady-{uuid.uuid4().hex[:6]}"
        p = Pipeline(pid, description="benchmark: the demo's shape with bounded state")
        t = trigger  # None: the stages' default
        lhs = p.source("left", lambda s: left(read_source(s, 1, mode, rate, batch)), trigger_interval=t)
        rhs = p.source("right", lambda s: right(read_source(s, 2, mode, rate, batch)), trigger_interval=t)
        joined = p.stage("joined", join, inputs=[lhs, rhs], trigger_interval=t)
        out = p.stage("report", report, inputs=[joined], trigger_interval=t)
        p.sink("sink", inputs=[out], foreach_batch=self.recorder, trigger_interval=t)
        super().__init__(PipelineDriver(p, store, storage_uri=str(tmp / pid), spark=spark), store, interval)
        if len(self.driver.runners) != 1:
            raise SystemExit(f"expected one fused query, got {[r.name for r in self.driver.runners]}")

    def queries(self) -> list[StreamingQuery]:
        return [r.query for r in self.driver.runners if r.query is not None]


# ------------------------------------------------------------------------------------------ measuring


def cpu_by_part() -> dict[str, float]:
    """CPU seconds so far of this process ("driver"), its JVM ("jvm") and Spark's Python processes ("python"),
    each with its reaped children's (a Python worker that ended counts in the daemon that forked it)."""
    procs = processes()
    me = os.getpid()
    parts = {"driver": procs[me].own + procs[me].reaped if me in procs else 0.0, "jvm": 0.0, "python": 0.0}
    for child in descendants(procs, me):
        c = procs[child]
        parts["python" if os.path.basename(c.program).startswith("python") else "jvm"] += c.own + c.reaped
    return parts


def batches_between(queries: list[StreamingQuery], start: float, end: float) -> int:
    """Micro-batches whose progress was reported in [start, end) (wall clock)."""
    from datetime import datetime

    n = 0
    for q in queries:
        for p in q.recentProgress:
            t = datetime.fromisoformat(p.timestamp.replace("Z", "+00:00")).timestamp()
            if start <= t < end:
                n += 1
    return n


@dataclass
class Result:
    mode: str
    side: str
    version: str
    round: int
    rows: int
    seconds: float
    cpu: dict[str, float]
    batches: int
    p50: float
    delivered_p50: float
    load: float

    @property
    def cpu_ms_per_krow(self) -> float:
        return 1e6 * sum(self.cpu.values()) / max(self.rows, 1)

    def part_ms_per_krow(self, part: str) -> float:
        return 1e6 * self.cpu[part] / max(self.rows, 1)

    @property
    def throughput(self) -> float:
        return self.rows / self.seconds


def run_in_child(out: Any, mode: str, side: str, version: str, rnd: int, rate: int, batch: int, dsn: str, tmp: str,
                 interval: float, warmup: float, duration: float, confs: dict[str, str]) -> None:
    logging.basicConfig(level=logging.WARNING)
    if version == "before":  # before the JVM starts: its Python workers inherit it
        os.environ[FREEZE_WORKER_HEAP_ENV] = "false"
    from pyspark import cloudpickle

    # WallClockGenerator, to the Python processes (this module is not importable there)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # type: ignore[no-untyped-call]
    confs = {"spark.sql.streaming.numRecentProgressUpdates": "1000", **confs}
    if side != "plain":
        confs = product_confs(confs)
    load = os.getloadavg()[0]
    spark = local_session_builder("arroyo-steady-cpu", confs=confs).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    store = EpochStore(dsn)
    try:
        running: Plain | Fused = (Plain(spark, mode, rate, batch, Path(tmp)) if side == "plain" else
                                  Fused(spark, store, mode, rate, batch, Path(tmp), interval,
                                        float(side.partition("@")[2]) if "@" in side else None))
        try:
            time.sleep(warmup)
            wall0, t0, cpu0 = time.time(), time.monotonic(), cpu_by_part()
            time.sleep(duration)
            wall1, t1, cpu1 = time.time(), time.monotonic(), cpu_by_part()
            rows, hist, delivered = running.recorder.window(t0, t1)
            batches = batches_between(running.queries(), wall0, wall1)
        finally:
            running.stop()
        r = Result(mode, side, version, rnd, rows, t1 - t0, {k: cpu1[k] - cpu0[k] for k in cpu0}, batches,
                   percentile(hist, 0.5), percentile(delivered, 0.5), load)
        out.put(r.__dict__)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
        spark.stop()


def show(r: Result) -> None:
    print(f"  {r.mode:8s} {r.side:9s} {r.version:6s} round {r.round}: load {r.load:4.1f}, {r.throughput:7.0f} rows/s, "
          f"{r.batches:4d} micro-batches, CPU {r.cpu_ms_per_krow:6.1f} ms per 1,000 rows (JVM "
          f"{r.part_ms_per_krow('jvm'):.1f}, Python workers {r.part_ms_per_krow('python'):.1f}, driver "
          f"{r.part_ms_per_krow('driver'):.1f})"
          + (f", p50 at the sink's call {r.p50:5.2f} s, delivered {r.delivered_p50:5.2f} s"
             if r.mode == "steady" else ""),
          flush=True)


def summarize(results: list[Result], mode: str, version: str) -> None:
    def of(side: str) -> list[Result]:
        return sorted((r for r in results if r.mode == mode and r.version == version and r.side == side),
                      key=lambda r: r.round)

    plain = of("plain")
    sides = sorted({r.side for r in results if r.side != "plain"})
    if not plain or not sides:
        return
    measures: dict[str, Callable[[Result], float]] = {
                "CPU per row": lambda r: r.cpu_ms_per_krow,
                "Python workers per row": lambda r: r.part_ms_per_krow("python"),
                "JVM per row": lambda r: r.part_ms_per_krow("jvm"),
                "micro-batches": lambda r: float(r.batches), "throughput": lambda r: r.throughput,
                "p50 at the sink's call": lambda r: r.p50, "delivered p50": lambda r: r.delivered_p50}
    if mode == "capacity":  # event time is the generator's own there, not the wall clock
        del measures["p50 at the sink's call"], measures["delivered p50"]
    for side in sides:
        fused = of(side)
        if not fused:
            continue
        print(f"  {mode}, {version}, {side}:")
        for name, f in measures.items():
            mp_, mf = statistics.median(f(r) for r in plain), statistics.median(f(r) for r in fused)
            rounds = [f(b) / f(a) for a, b in zip(plain, fused, strict=False) if f(a)]
            ratio = mf / mp_ if mp_ else float("nan")
            print(f"    {name:24s} plain {mp_:9.2f}  {side} {mf:9.2f}  {side} / plain {ratio:.2f}x"
                  f"  (rounds {', '.join(f'{x:.2f}' for x in rounds)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["steady", "capacity"], choices=["steady", "capacity"])
    parser.add_argument("--rate", type=int, default=1000, help="rows/s per source (steady; a divisor of 1000)")
    parser.add_argument("--capacity-batch", type=int, default=5000, help="rows per source per micro-batch (capacity)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--capacity-rounds", type=int, default=1)
    parser.add_argument("--sides", nargs="+", default=["plain", "fused"], choices=["plain", "fused"])
    parser.add_argument("--fused-triggers", nargs="*", type=float, default=[],
                        help="more fused sides, every stage with this trigger_interval (fused@T), with --versions' "
                             "last version only")
    parser.add_argument("--versions", nargs="+", default=["before", "after"], choices=["before", "after"])
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--duration", type=float, default=35.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between epochs (fused)")
    parser.add_argument("--conf", action="append", default=[], type=conf_pair, metavar="K=V",
                        help="a Spark conf for every side's session")
    args = parser.parse_args(argv)
    if 1000 % args.rate:
        parser.error("--rate must divide 1000 (a row's event time is id * 1000 / rate ms)")
    logging.basicConfig(level=logging.WARNING)
    results: list[Result] = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-steady-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        store.close()
        print(f"local[2], steady {args.rate} rows/s per source, capacity {args.capacity_batch} rows per source per "
              f"batch; warm-up {args.warmup:g} s, {args.duration:g} s measured, epochs every {args.interval:g} s "
              "(fused); a process per run", flush=True)
        for mode in args.modes:
            runs = [(side, version) for version in args.versions for side in args.sides]
            runs += [(f"fused@{t:g}", args.versions[-1]) for t in args.fused_triggers]
            for i in range(args.rounds if mode == "steady" else args.capacity_rounds):
                for side, version in runs if i % 2 == 0 else runs[::-1]:
                    got = run_in_process(run_in_child, (
                        mode, side, version, i + 1, args.rate, args.capacity_batch, pg.dsn, tmp, args.interval,
                        args.warmup, args.duration, dict(args.conf)), timeout=args.warmup + args.duration + 900,
                        what=f"{mode} {side} {version} run")
                    results.append(Result(**got))
                    show(results[-1])
    print("\nmedians over rounds, and fused / plain per round (CPU per row: ms per 1,000 rows; latency: s):")
    for mode in args.modes:
        for version in args.versions:
            summarize(results, mode, version)
    return 0


if __name__ == "__main__":
    sys.exit(main())
