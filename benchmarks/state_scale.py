"""State at scale: epochs, bytes new, and restore-to-first-output against a cold start, at growing state sizes.

One invocation, one SparkSession (local[2]), one throwaway PostgreSQL. For each ``--keys`` size and each
``--store`` (``rocksdb``, ``hdfs`` = Spark's default store), one pipeline (the deterministic generator with
``--pad`` bytes of padding per key, hex digits of hashes so that no store compresses them away, into a stateful
aggregation per key that keeps the longest padding seen, into a ``foreach_batch`` sink) runs as the product runs
it (``PipelineDriver``, epochs every ``--interval`` s):

1. **fill**: until the state holds every key, then ``--epochs`` more epochs; printed: state bytes of the last
   epoch's snapshot, epoch duration p50/p99 (trigger to completion, from the store) and bytes new per epoch
   (median);
2. **restore-to-first-output** against a **cold start**, alternating (``--rounds``): the filled pipeline restored
   from its latest epoch, and the same code started fresh elsewhere, each timed from ``run()`` to the first
   micro-batch with rows reaching the sink (the same number of new rows, ``--batch``, in both). Printed: each
   median and their ratio (restore / cold; the target is <= 1).

Figures measured here are in benchmarks/results/state_scale.md.

    python benchmarks/state_scale.py                                  # 2 sizes, rocksdb and hdfs, ~10 minutes
    python benchmarks/state_scale.py --keys 4000000 --store rocksdb   # about 1 GB of state
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import conf_pair, local_session_builder

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for

FIRST_OUTPUT: dict[str, float] = {}  # pipeline id -> when its sink first saw rows (monotonic)
_LOCK = threading.Lock()


def _sink(pid: str) -> Any:
    def write(df: Any, _batch: int) -> None:
        if pid not in FIRST_OUTPUT and not df.isEmpty():
            with _LOCK:
                FIRST_OUTPUT.setdefault(pid, time.monotonic())

    return write


def pipeline(pid: str, *, keys: int, pad: int, batch: int, store: str, start: int = 0) -> Pipeline:
    from pyspark.sql import functions as F

    def read(spark: Any) -> Any:
        df = generator_source(spark, keys=keys, rows_per_batch=batch, start=start, partitions=2)
        # key = id mod keys: the state holds every key once `keys` rows are in
        return df.select((F.col("id") % keys).alias("key"), "value")

    def aggregate(df: Any) -> Any:
        # the padding is made here, so that only the state holds it (not the channels); hashes, so that no store's
        # compression shrinks it to nothing
        hashes = F.concat(*[F.sha2(F.concat_ws("/", F.col("key").cast("string"), F.lit(str(i))), 512)
                            for i in range(pad // 128 + 1)])
        padded = df.withColumn("pad", F.substring(hashes, 1, pad))
        return (padded.groupBy("key").agg(F.count(F.lit(1)).alias("n"), F.sum("value").alias("total"),
                                         F.max("pad").alias("pad"))
                .select("key", "n", "total", F.length("pad").alias("pad_len")))  # uses it: the state keeps it

    p = Pipeline(pid, chaining=False)
    src = p.source("src", read)
    agg = p.stage("agg", aggregate, [src], output_mode="update", state_store=store,  # type: ignore[arg-type]
                  spark_conf={"spark.sql.shuffle.partitions": "4"})
    p.sink("out", [agg], foreach_batch=_sink(pid))
    return p


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def fill(spark: Any, store: EpochStore, root: Path, args: argparse.Namespace, keys: int, kind: str) -> dict[str, Any]:
    pid = f"scale-{kind}-{keys}-{uuid.uuid4().hex[:4]}"
    storage = str(root / pid)
    # one micro-batch per --batch rows: enough batches that every key is seen
    driver = PipelineDriver(pipeline(pid, keys=keys, pad=args.pad, batch=max(args.batch, keys // 4), store=kind),
                            store, storage_uri=storage, spark=spark)
    thread = DriverThread(driver).start()
    t0 = time.monotonic()
    with CheckpointTicker(store, pid, interval=args.interval, timeout=600):
        wait_for(lambda: thread.error or driver.started.is_set(), timeout=600, what="the queries to start")

        src = driver.layout.channel_uri("src")
        wait_for(lambda: thread.error or channel_row_count(src) >= keys, timeout=3600, interval=1.0,
                 what=f"{keys} rows read")
        # the epoch after the one in flight now cuts the aggregation after those rows
        started = store.in_flight_epoch(pid) or store.latest_completed_epoch(pid)
        assert started is not None
        done = started
        def epochs_after() -> int:
            latest = store.latest_completed_epoch(pid)
            return latest.epoch - done.epoch if latest is not None else -1

        wait_for(lambda: thread.error or epochs_after() >= args.epochs, timeout=3600, interval=1.0,
                 what=f"{args.epochs} more epochs")
    if thread.error is not None:
        raise thread.error
    store.request_stop(pid, "graceful")
    thread.join(1200)
    fill_s = time.monotonic() - t0
    epochs = [e for e in store.list_epochs(pid, limit=10_000, states=[EpochState.COMPLETED])
              if e.ended_at is not None and e.epoch > done.epoch - 1]
    durations = [(e.ended_at - e.triggered_at).total_seconds() for e in epochs]  # type: ignore[operator]
    latest = store.latest_completed_epoch(pid)
    assert latest is not None
    state = [a for a in store.acks(pid, latest.epoch) if a.stage == "agg"][0]
    return {"pid": pid, "storage": storage, "fill_s": fill_s,
            "state_bytes": int((state.details or {}).get("state_bytes") or 0),
            "epoch_p50": pct(durations, 50), "epoch_p99": pct(durations, 99),
            "bytes_new_p50": statistics.median([e.bytes_new or 0 for e in epochs]) if epochs else 0,
            "epochs": len(epochs)}


def first_output(spark: Any, store: EpochStore, args: argparse.Namespace, pid: str, storage: str, keys: int,
                 kind: str, restore: bool) -> float:
    """Seconds from run() to the first rows at the sink; the run is then stopped at once."""
    FIRST_OUTPUT.pop(pid, None)
    code = pipeline(pid, keys=keys, pad=args.pad, batch=args.batch, store=kind)
    driver = PipelineDriver(code, store, storage_uri=storage, spark=spark,
                            restore_from="latest" if restore else None, takeover=True)
    t0 = time.monotonic()
    thread = DriverThread(driver).start()
    wait_for(lambda: thread.error or pid in FIRST_OUTPUT, timeout=1800, interval=0.05, what="the first output")
    took = FIRST_OUTPUT[pid] - t0
    store.request_stop(pid, "immediate")
    thread.join(1200)
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="200000,1000000", help="state sizes in keys, comma-separated")
    ap.add_argument("--store", default="rocksdb,hdfs", help="state stores, comma-separated")
    ap.add_argument("--pad", type=int, default=200, help="bytes of padding kept per key")
    ap.add_argument("--batch", type=int, default=20_000, help="rows per micro-batch after the fill")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between epochs")
    ap.add_argument("--epochs", type=int, default=3, help="epochs after the state is full")
    ap.add_argument("--rounds", type=int, default=2, help="restore / cold start pairs (order alternates)")
    ap.add_argument("--driver-memory", default="8g")
    ap.add_argument("--conf", type=conf_pair, action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    spark = local_session_builder("arroyo-state-scale", driver_memory=args.driver_memory,
                                  confs=dict(args.conf)).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    rows = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-scale-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        for keys in (int(k) for k in args.keys.split(",")):
            for kind in args.store.split(","):
                filled = fill(spark, store, Path(tmp), args, keys, kind)
                restored, cold = [], []
                for r in range(args.rounds):
                    for restore in ((True, False) if r % 2 == 0 else (False, True)):
                        if restore:
                            restored.append(first_output(spark, store, args, filled["pid"], filled["storage"], keys,
                                                         kind, True))
                        else:
                            cold_pid = f"cold-{uuid.uuid4().hex[:6]}"
                            cold.append(first_output(spark, store, args, cold_pid, f"{tmp}/{cold_pid}", keys,
                                                     kind, False))
                shutil.rmtree(filled["storage"], ignore_errors=True)  # the next size needs the disk
                for folder in Path(tmp).glob("cold-*"):
                    shutil.rmtree(folder, ignore_errors=True)
                row = {**filled, "keys": keys, "store": kind, "restore_s": statistics.median(restored),
                       "cold_s": statistics.median(cold), "restore_runs": restored, "cold_runs": cold}
                rows.append(row)
                print(f"{kind:>7} {keys:>9,} keys: state {row['state_bytes'] / 1e6:,.1f} MB, "
                      f"fill {row['fill_s']:.0f} s,"
                      f" epoch p50 {row['epoch_p50']:.2f} s p99 {row['epoch_p99']:.2f} s, bytes new p50 "
                      f"{row['bytes_new_p50'] / 1e6:,.1f} MB; first output: restore {row['restore_s']:.1f} s "
                      f"{[round(x, 1) for x in restored]}, cold {row['cold_s']:.1f} s {[round(x, 1) for x in cold]},"
                      f" restore / cold {row['restore_s'] / row['cold_s']:.2f}", flush=True)
        store.close()
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
