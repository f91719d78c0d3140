"""Latency and throughput: the product against ONE plain Structured Streaming query of the same logic.

Not source-bound: both sides read Spark's ``rate`` source (rows generated on the wall clock, no Python
data source in front). The logic is the demo's shape: two sources, a stream-stream join (keyed state,
bounded by watermarks), a filter, and a ``foreach_batch`` sink that records, for every row it receives,
the event -> sink latency in histograms of 10 ms buckets, and the time it arrived. Two latencies per row:
**at the sink's call** (the wall time when the sink's ``foreach_batch`` is called minus the rate row's
timestamp), and **delivered** (when the sink's Spark job over the batch has returned: the row is computed
and out). A ``foreach_batch`` DataFrame is lazy, so "at the call" counts rows of a fused or plain query as
arrived before their batch's join ran, while a channel's reader gets rows its writer computed before;
"delivered" counts the same work on every side.

* **plain**: one query, ``checkpointLocation`` in a temporary folder, default trigger, Spark's default
  settings (the query a user would write).
* **product** (unfused: one query per stage, a channel per edge) and **fused** (``Pipeline(chaining=True)``,
  operator chaining): the same logic as an airflow-arroyo ``Pipeline`` (sources ``left``/``right``, stage
  ``joined``, stage ``report``, sink ``sink``) run by the driver in this process on the same SparkSession,
  with an epoch every ``--interval`` seconds (the benchmark plays the Airflow trigger). The fused side
  prints its physical plan. Their sessions start as the driver starts a local one
  (``airflow_arroyo.jvm.local_master_conf``): ``file:`` through the provider's jar (no ``chmod`` processes),
  Python workers over a Unix domain socket; ``--hadoop-local-fs`` leaves Hadoop's ``file:``, and ``--conf
  spark.python.unix.domain.socket.enabled=false`` loopback TCP.
* **boundary**: the fused pipeline with ONE channel left, before the sink (``chain=False``, as the demo keeps
  its ``report`` channel): what one remaining channel hop costs where the plan keeps few, as the default
  plan does (two queries instead of the unfused form's five sharing the cores).
* **spark-hop** (``--spark-hop``): the plain logic as two plain queries split at the same place, Spark's
  ``parquet`` file sink into its file source (exactly-once through the sink's ``_spark_metadata`` log),
  Spark's defaults as plain: the hop a user builds without the product, against which the remaining hop
  compares (spark-hop p50 - plain p50).

For each input rate (rows/s per source) the runs alternate (plain, product, fused, then reversed, ... over
``--rounds``; ``--masters local[2] local[4]`` alternates those too; ``--driver-memory``, default 2g;
``--conf K=V`` for every side's session), each in a process of its own (a fresh Spark driver JVM: one JVM
for every run ran out of its 2 GB heap at 20,000 rows/s after seven runs), ``--warmup`` seconds, then
``--duration`` seconds measured: throughput (rows reaching the sink per second) and latency p50/p99 of the
rows that reached the sink in the window. Prints each run, then per rate the ratios product/plain (latency
p50, p99, throughput) and what a channel hop adds (issue 12's target: at most one trigger interval + 200
ms): a remaining hop, boundary p50 - fused p50, a hop of the unfused form, (unfused p50 - fused p50) /
the channels on its longest path, and with ``--spark-hop`` Spark's own hop. Side by side in one run, so load
on the machine affects both.

    python benchmarks/latency.py                               # 2 rates x 1 round: about 6 minutes
    python benchmarks/latency.py --rates 2000 20000 --rounds 2 --duration 60
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import DrivenPipeline, conf_pair, local_session_builder, product_confs, run_in_process

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

BUCKET_S = 0.01
PLAIN_SIDES = ("plain", "spark-hop")  # Spark's own queries: Spark's defaults, no epochs
JOIN_WINDOW = "30 seconds"  # the two sources of the product start a little apart: matching ids are this close


# ------------------------------------------------------------------------------------------ the logic, once


def read_rate(spark: SparkSession, rate: int, prefix: str) -> DataFrame:
    df = (spark.readStream.format("rate").option("rowsPerSecond", rate).option("numPartitions", 2).load())
    return df.selectExpr(f"value AS {prefix}_id", f"timestamp AS {prefix}_ts", f"value % 100 AS {prefix}_key")


def join(lhs: DataFrame, rhs: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    lhs = lhs.withWatermark("l_ts", "10 seconds")
    rhs = rhs.withWatermark("r_ts", "10 seconds")
    cond = F.expr(f"l_id = r_id AND r_ts BETWEEN l_ts - INTERVAL {JOIN_WINDOW} AND l_ts + INTERVAL {JOIN_WINDOW}")
    return lhs.join(rhs, cond)


def report(joined: DataFrame) -> DataFrame:
    return joined.selectExpr("l_id AS id", "l_key AS key", "l_ts AS ts", "l_id + r_id AS total").where(
        "total % 7 <> 0")


# ------------------------------------------------------------------------------------------ measuring


def count_per_bucket(df: DataFrame) -> list[Any]:
    """The sink's Spark job: rows per 10 ms of event time (``t``, ``count``), collected.

    The same expression every batch: with the clock in it (a literal) Spark would generate, compile and warm
    up new code for every batch of every side."""
    return df.selectExpr(f"CAST(FLOOR(CAST(ts AS DOUBLE) / {BUCKET_S}) AS BIGINT) AS t").groupBy("t").count().collect()


@dataclass
class Recorder:
    """What the sink saw: per micro-batch, when it ran, its rows and their latency histogram."""

    batches: list[tuple[float, int, Counter[int], int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, df: DataFrame, batch_id: int) -> None:  # noqa: ARG002 - foreach_batch's signature
        now = time.time()
        rows = count_per_bucket(df)
        job_buckets = round((time.time() - now) / BUCKET_S)  # the job's time, added for "delivered"
        # latency bucket of an event-time bucket's middle: at most half a bucket (5 ms) from each row's own
        hist = Counter[int]()
        for r in rows:
            hist[math.floor(now / BUCKET_S - int(r["t"]) - 0.5)] += int(r["count"])
        with self.lock:
            self.batches.append((time.monotonic(), sum(hist.values()), hist, job_buckets))

    def window(self, start: float, end: float) -> tuple[int, Counter[int], Counter[int]]:
        """Rows that reached the sink in [start, end), their latencies at the sink's call and delivered."""
        total, at_call, delivered = 0, Counter[int](), Counter[int]()
        with self.lock:
            for t, n, h, job in self.batches:
                if start <= t < end:
                    total += n
                    at_call.update(h)
                    delivered.update({b + job: c for b, c in h.items()})
        return total, at_call, delivered


def percentile(hist: Counter[int], q: float) -> float:
    """The q-quantile (seconds) of a histogram of 10 ms buckets."""
    n = sum(hist.values())
    if not n:
        return float("nan")
    target, seen = q * n, 0
    for b in sorted(hist):
        seen += hist[b]
        if seen >= target:
            return (b + 0.5) * BUCKET_S
    return (max(hist) + 0.5) * BUCKET_S


@dataclass
class Result:
    side: str
    rate: int
    rows: int
    seconds: float
    p50: float
    p99: float
    epochs: int = 0
    epoch_p50: float = float("nan")
    delivered_p50: float = float("nan")
    delivered_p99: float = float("nan")
    master: str = "local[2]"

    @property
    def throughput(self) -> float:
        return self.rows / self.seconds


# ------------------------------------------------------------------------------------------ the two sides


class Plain:
    """The logic as one Structured Streaming query."""

    def __init__(self, spark: SparkSession, rate: int, tmp: Path) -> None:
        self.recorder = Recorder()
        joined = join(read_rate(spark, rate, "l"), read_rate(spark, rate, "r"))
        self.query = (report(joined).writeStream.foreachBatch(self.recorder)
                      .option("checkpointLocation", str(tmp / f"plain-{uuid.uuid4().hex[:6]}")).start())

    def epochs(self, since: float) -> tuple[int, float]:  # noqa: ARG002 - the same interface as Product
        return 0, float("nan")

    def stop(self) -> None:
        self.query.stop()


class SparkHop:
    """The plain logic as TWO plain queries, split where the boundary side keeps its channel (before the sink):
    the first writes Spark's ``parquet`` file sink, the second reads its folder with Spark's file source (which
    follows the sink's ``_spark_metadata`` log: exactly-once) into the sink. The hop a user builds without
    the product; Spark's defaults, default trigger, as ``Plain``."""

    def __init__(self, spark: SparkSession, rate: int, tmp: Path) -> None:
        self.recorder = Recorder()
        base = tmp / f"spark-hop-{uuid.uuid4().hex[:6]}"
        rows = report(join(read_rate(spark, rate, "l"), read_rate(spark, rate, "r")))
        self.writer = (rows.writeStream.format("parquet").option("path", str(base / "data"))
                       .option("checkpointLocation", str(base / "writer")).start())
        self.query = (spark.readStream.schema(rows.schema).parquet(str(base / "data")).writeStream
                      .foreachBatch(self.recorder).option("checkpointLocation", str(base / "reader")).start())

    def epochs(self, since: float) -> tuple[int, float]:  # noqa: ARG002 - the same interface as Product
        return 0, float("nan")

    def stop(self) -> None:
        self.query.stop()
        self.writer.stop()


def pipeline(pid: str, rate: int, recorder: Recorder, *, chaining: bool, boundary: bool = False) -> Pipeline:
    p = Pipeline(pid, description="benchmark: two rate sources, a stream-stream join, a filter", chaining=chaining)
    left = p.source("left", lambda spark: read_rate(spark, rate, "l"))
    right = p.source("right", lambda spark: read_rate(spark, rate, "r"))
    joined = p.stage("joined", join, inputs=[left, right])
    out = p.stage("report", report, inputs=[joined])
    p.sink("sink", inputs=[out], foreach_batch=recorder, chain=not boundary)  # boundary: the report channel stays
    return p


def channel_hops(p: Pipeline) -> int:
    """Channels on the longest path from a source to a sink when every edge is one (the unfused form)."""
    specs = {s.name: s for s in p.stages}
    writer = {s.output: s.name for s in specs.values() if s.output}

    def depth(name: str) -> int:
        return max((1 + depth(writer[c]) for c in specs[name].inputs if c in writer), default=0)

    return max(depth(n) for n in specs)


class Product(DrivenPipeline):
    """The logic as an airflow-arroyo pipeline, driven in a thread, with an epoch every ``interval``."""

    def __init__(self, spark: SparkSession, store: EpochStore, rate: int, tmp: Path, interval: float, *,
                 chaining: bool, boundary: bool = False) -> None:
        self.recorder = Recorder()
        pid = f"latency-{uuid.uuid4().hex[:6]}"
        p = pipeline(pid, rate, self.recorder, chaining=chaining, boundary=boundary)
        if chaining:
            print("    " + p.explain(spark).replace("\n", "\n    "), flush=True)
        super().__init__(PipelineDriver(p, store, storage_uri=str(tmp / pid), spark=spark), store, interval)

    def epochs(self, since: float) -> tuple[int, float]:
        """Epochs completed since wall time ``since`` and their duration p50."""
        done = [e.duration_s for e in self.store.list_epochs(self.pid, limit=10_000)
                if e.state is EpochState.COMPLETED and e.duration_s is not None
                and e.triggered_at.timestamp() >= since]
        return len(done), (statistics.median(done) if done else float("nan"))


def run_one(make: Callable[[], Plain | SparkHop | Product], side: str, rate: int, warmup: float, duration: float,
            master: str) -> Result:
    running = make()
    try:
        time.sleep(warmup)
        wall, start = time.time(), time.monotonic()
        time.sleep(duration)
        end = time.monotonic()
        rows, hist, delivered = running.recorder.window(start, end)
        epochs, epoch_p50 = running.epochs(wall)
    finally:
        running.stop()
    r = Result(side, rate, rows, end - start, percentile(hist, 0.5), percentile(hist, 0.99), epochs, epoch_p50,
               percentile(delivered, 0.5), percentile(delivered, 0.99), master)
    extra = f", {r.epochs} epochs (duration p50 {r.epoch_p50:.2f} s)" if side not in PLAIN_SIDES else ""
    print(f"  {master} {side:8s} rate {rate:>6}/s: {r.throughput:9.0f} rows/s, latency at the sink's call "
          f"p50 {r.p50:6.2f} s, p99 {r.p99:6.2f} s; delivered p50 {r.delivered_p50:6.2f} s, "
          f"p99 {r.delivered_p99:6.2f} s{extra}",
          flush=True)
    return r


def run_in_child(out: Any, side: str, rate: int, dsn: str, tmp: str, interval: float, warmup: float,
                 duration: float, hadoop_local_fs: bool = False, master: str = "local[2]",
                 driver_memory: str = "2g", confs: dict[str, str] | None = None) -> None:
    """One run in a process of its own: its own Spark driver JVM and store connection; the result (or the
    error's text) goes back through ``out``."""
    logging.basicConfig(level=logging.WARNING)
    confs = dict(confs or {})
    if side not in PLAIN_SIDES:  # as the driver builds a local session; plain: Spark's defaults (a user's query)
        confs = product_confs(confs, hadoop_local_fs=hadoop_local_fs)
    spark = local_session_builder("arroyo-latency", master=master, driver_memory=driver_memory,
                                  confs=confs).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    store = EpochStore(dsn)
    try:
        def make() -> Plain | SparkHop | Product:
            if side == "plain":
                return Plain(spark, rate, Path(tmp))
            if side == "spark-hop":
                return SparkHop(spark, rate, Path(tmp))
            return Product(spark, store, rate, Path(tmp), interval, chaining=side in ("fused", "boundary"),
                           boundary=side == "boundary")
        out.put(run_one(make, side, rate, warmup, duration, master).__dict__)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        store.close()
        spark.stop()


def summarize(results: list[Result], master: str, rate: int, *, chaining: bool, boundary: bool,
              spark_hop: bool = False) -> list[dict[str, Any]]:
    """Print (and return) the ratios to plain and the hops, for the runs on ``master`` at ``rate``."""
    def med(side: str, attr: str) -> float:
        return float(statistics.median(getattr(r, attr) for r in results
                                       if r.side == side and r.rate == rate and r.master == master))

    summary: list[dict[str, Any]] = []
    at = f"{master} rate {rate:>6}/s"
    empty = sorted({r.side for r in results if r.rate == rate and r.master == master and not r.throughput})
    if empty:  # a ratio to nothing: say so rather than divide by zero
        raise SystemExit(f"{at}: no row reached the sink of {', '.join(empty)} in the measured window (a slow start on "
                         "a busy machine); give the runs longer with --warmup and --duration")
    for side in ("product", "fused", *(("boundary",) if boundary else ())) if chaining else ("product",):
        row = {"master": master, "rate": rate, "side": side,
               "latency_p50_ratio": med(side, "p50") / med("plain", "p50"),
               "latency_p99_ratio": med(side, "p99") / med("plain", "p99"),
               "delivered_p50_ratio": med(side, "delivered_p50") / med("plain", "delivered_p50"),
               "delivered_p99_ratio": med(side, "delivered_p99") / med("plain", "delivered_p99"),
               "throughput_ratio": med(side, "throughput") / med("plain", "throughput")}
        summary.append(row)
        print(f"  {at}, {side:8s}: latency at the sink's call p50 {row['latency_p50_ratio']:.2f}x, "
              f"p99 {row['latency_p99_ratio']:.2f}x; delivered p50 {row['delivered_p50_ratio']:.2f}x, "
              f"p99 {row['delivered_p99_ratio']:.2f}x; throughput {row['throughput_ratio']:.2f}x")
    if chaining:
        hops = channel_hops(pipeline("hops", rate, Recorder(), chaining=False))
        for attr, measure in (("p50", "at the sink's call"), ("delivered_p50", "delivered")):
            per_hop = (med("product", attr) - med("fused", attr)) / hops
            summary.append({"master": master, "rate": rate, "side": "hop", "measure": attr, "hops": hops,
                            "per_hop_p50_s": per_hop})
            print(f"  {at}, per channel hop ({measure}): (unfused p50 {med('product', attr):.2f} s - "
                  f"fused p50 {med('fused', attr):.2f} s) / {hops} hops = {per_hop * 1000:.0f} ms")
            if boundary:
                remaining = med("boundary", attr) - med("fused", attr)
                summary.append({"master": master, "rate": rate, "side": "remaining-hop", "measure": attr,
                                "per_hop_p50_s": remaining})
                print(f"  {at}, one remaining channel hop ({measure}): boundary p50 "
                      f"{med('boundary', attr):.2f} s - fused p50 {med('fused', attr):.2f} s = "
                      f"{remaining * 1000:.0f} ms")
    if spark_hop:
        for attr, measure in (("p50", "at the sink's call"), ("delivered_p50", "delivered")):
            own = med("spark-hop", attr) - med("plain", attr)
            summary.append({"master": master, "rate": rate, "side": "spark-hop", "measure": attr,
                            "per_hop_p50_s": own})
            print(f"  {at}, Spark's own hop ({measure}): spark-hop p50 {med('spark-hop', attr):.2f} s - "
                  f"plain p50 {med('plain', attr):.2f} s = {own * 1000:.0f} ms")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=int, nargs="+", default=[2000, 20000], help="rows/s per source")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per rate (a round = plain + product)")
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between epochs (product)")
    parser.add_argument("--no-chaining", dest="chaining", action="store_false",
                        help="leave out the fused side (the pipeline with Pipeline(chaining=True))")
    parser.add_argument("--no-boundary", dest="boundary", action="store_false",
                        help="leave out the boundary side (the fused pipeline with one channel left, before the sink)")
    parser.add_argument("--spark-hop", action="store_true",
                        help="add the spark-hop side: the plain logic as two plain queries joined by Spark's parquet "
                             "file sink and file source (Spark's own hop, against which the remaining hop compares)")
    parser.add_argument("--hadoop-local-fs", action="store_true",
                        help="the product's sessions on Hadoop's own file: file system (chmod processes), as before "
                             "airflow_arroyo.jvm")
    parser.add_argument("--masters", nargs="+", default=["local[2]"],
                        help="Spark masters to compare, alternating (local[N]: N task slots; this machine has 2 "
                             "cores); the ratios and hops are printed per master")
    parser.add_argument("--driver-memory", default="2g",
                        help="the driver JVM's heap, every side (local mode: the whole run's; the join's state lives "
                             "there)")
    parser.add_argument("--conf", action="append", default=[], type=conf_pair, metavar="K=V",
                        help="a Spark conf for every side's session (e.g. the state store provider)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    confs = dict(args.conf)

    results: list[Result] = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-latency-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        store.close()
        print(f"{' / '.join(args.masters)}, rates {args.rates} rows/s per source, {args.rounds} round(s), "
              f"warm-up {args.warmup:g} s, {args.duration:g} s measured, epochs every {args.interval:g} s (product); "
              "a process per run", flush=True)
        for rate in args.rates:
            sides = ["plain", "product", "fused"] if args.chaining else ["plain", "product"]
            if args.chaining and args.boundary:
                sides.append("boundary")
            if args.spark_hop:
                sides.append("spark-hop")
            for i in range(args.rounds):
                for master in args.masters if i % 2 == 0 else args.masters[::-1]:
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        got = run_in_process(run_in_child, (
                            side, rate, pg.dsn, tmp, args.interval, args.warmup, args.duration, args.hadoop_local_fs,
                            master, args.driver_memory, confs), timeout=args.warmup + args.duration + 900,
                            what=f"{side} run at {rate} rows/s on {master}")
                        results.append(Result(**got))

    print("\nproduct and fused / plain, per master and rate (median over rounds):")
    summary = []
    for master in args.masters:
        for rate in args.rates:
            summary += summarize(results, master, rate, chaining=args.chaining, boundary=args.boundary,
                                 spark_hop=args.spark_hop)
    if args.json:
        print(json.dumps({"runs": [r.__dict__ | {"throughput": r.throughput} for r in results], "ratios": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
