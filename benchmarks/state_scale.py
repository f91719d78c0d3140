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
   median and their ratio (restore / cold; the target is <= 1), and the phases of each start side by side
   (``airflow_arroyo.runtime.startup``: plan, check, rebuild, roll_forward, queries, first_batch; medians) with
   the aggregation's first micro-batch as Spark timed it (where a restored state store loads its state).

``--modes`` restores in each named way per round, side by side: ``link`` (as the product does: objects hard-linked
into the rebuilt checkpoint where they share a local file system with it, RocksDB's SST files linked into its
working folder by the provider's file system) and ``copy`` (every object copied into the checkpoint and every SST
file copied into RocksDB's working folder, as before the links) and ``serial`` (linked, but without the batch of
no rows a resumed channel reader offers at its start: each stage reading a channel then runs its first batch only
once the stage before it writes, one after another, as before that batch) and ``download`` (linked, but every
object read from the snapshots' storage even where the local live checkpoint still holds the file: with
``s3-objects``, the restore before local recovery). The session is a local master's as the driver
builds it (``airflow_arroyo.jvm.local_master_conf``: the provider's ``file:`` file system).

``--placements`` runs each size where its state lives: ``local`` (channels, snapshots and Spark's checkpoints on the
local disk), ``s3`` (all of them on a moto S3 server on 127.0.0.1 started by the benchmark: channels and
snapshots through pyarrow, Spark's checkpoints through ``s3a://`` derived from the storage URI, as a user's
``s3://`` storage URI gives them; the cold start's storage there too) and/or ``s3-objects`` (channels and snapshots
on S3, Spark's checkpoints on the local disk: ``--checkpoint-uri``, Flink's split of durable snapshots and local
working state). moto answers from memory on loopback: read
the ``s3`` figures as "the S3 API through the network stack", not as a region's latencies.

Figures measured here are in benchmarks/results/state_scale.md.

    python benchmarks/state_scale.py                                  # 2 sizes, rocksdb and hdfs, ~10 minutes
    python benchmarks/state_scale.py --keys 4000000 --store rocksdb   # about 1 GB of state
    python benchmarks/state_scale.py --keys 200000 --pad 1000 --store rocksdb --placements local,s3,s3-objects
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import conf_pair, local_session_builder

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.jvm import local_master_conf
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.stage import StageRunner
from airflow_arroyo.runtime.startup import PHASES, start_phases
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for

FIRST_OUTPUT: dict[str, float] = {}  # pipeline id -> when its sink first saw rows (monotonic)
LINK_SST_FILES = "airflow.arroyo.linkSstFiles"  # the provider's file system: link RocksDB's SST files (default on)
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


class MotoS3:
    """A moto S3 server on 127.0.0.1 with the AWS SDK's settings for it in this process's environment (pyarrow's
    ``s3://`` and, through ``local_master_conf``, Spark's ``s3a://`` reach it)."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a log line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true"})

    def new_bucket(self) -> str:
        import boto3

        name = f"arroyo-scale-{uuid.uuid4().hex[:8]}"
        boto3.client("s3").create_bucket(Bucket=name)
        return name

    def drop_bucket(self, uri: str) -> None:
        import boto3

        bucket = boto3.resource("s3").Bucket(uri.removeprefix("s3://"))
        bucket.objects.all().delete()
        bucket.delete()

    def stop(self) -> None:
        self.server.stop()


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else (values[0] if values else 0.0)


def fill(spark: Any, store: EpochStore, root: str, args: argparse.Namespace, keys: int, kind: str,
         checkpoints: str | None) -> dict[str, Any]:
    pid = f"scale-{kind}-{keys}-{uuid.uuid4().hex[:4]}"
    storage = f"{root}/{pid}"
    # one micro-batch per --batch rows: enough batches that every key is seen
    driver = PipelineDriver(pipeline(pid, keys=keys, pad=args.pad, batch=max(args.batch, keys // 4), store=kind),
                            store, storage_uri=storage, spark=spark,
                            checkpoint_uri=f"{checkpoints}/{pid}" if checkpoints else None)
    thread = DriverThread(driver).start()
    t0 = time.monotonic()
    with CheckpointTicker(store, pid, interval=args.interval, timeout=600):
        wait_for(lambda: thread.error or driver.started.is_set(), timeout=600, what="the queries to start")

        src = driver.layout.channel_uri("src")
        wait_for(lambda: thread.error or channel_row_count(src) >= keys, timeout=3600, interval=1.0,
                 what=f"{keys} rows read")
        # the epoch after the one in flight now cuts the aggregation after those rows (a small state is read before
        # the first epoch starts: wait for one)
        wait_for(lambda: thread.error or store.in_flight_epoch(pid) or store.latest_completed_epoch(pid),
                 timeout=600, what="an epoch")
        started = store.in_flight_epoch(pid) or store.latest_completed_epoch(pid)
        assert started is not None, thread.error
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
            "snapshot_bytes": latest.bytes_total or 0,
            "epoch_p50": pct(durations, 50), "epoch_p99": pct(durations, 99),
            "bytes_new_p50": statistics.median([e.bytes_new or 0 for e in epochs]) if epochs else 0,
            "epochs": len(epochs)}


def first_output(spark: Any, store: EpochStore, args: argparse.Namespace, pid: str, storage: str, keys: int,
                 kind: str, mode: str | None, checkpoints: str | None) -> dict[str, float]:
    """Seconds from run() to the first rows at the sink (``output``), each start phase, and the aggregation's
    first micro-batch as Spark timed it (``agg_batch``); the run is then stopped at once. ``mode``: how to restore
    (``link``/``copy``/``serial``), None for a cold start."""
    FIRST_OUTPUT.pop(pid, None)
    code = pipeline(pid, keys=keys, pad=args.pad, batch=args.batch, store=kind)
    driver = PipelineDriver(code, store, storage_uri=storage, spark=spark,
                            checkpoint_uri=f"{checkpoints}/{pid}" if checkpoints else None,
                            restore_from="latest" if mode is not None else None, takeover=True)
    driver.snapshots.link_objects = mode != "copy"
    driver.snapshots.reuse_live_files = mode not in ("copy", "download")
    StageRunner.warm_resumed_inputs = mode != "serial"
    jvm = spark.sparkContext._jvm
    jvm.java.lang.System.setProperty(LINK_SST_FILES, "false" if mode == "copy" else "true")
    t0 = time.monotonic()
    wall0 = time.time()
    thread = DriverThread(driver).start()
    wait_for(lambda: thread.error or pid in FIRST_OUTPUT, timeout=1800, interval=0.05, what="the first output")
    took = FIRST_OUTPUT[pid] - t0
    wait_for(lambda: thread.error or driver.started.is_set(), timeout=600, what="the start to end")
    firsts = {}
    for runner in driver.runners:
        # each query's first micro-batch that ran (idle triggers report progress too, without addBatch): when it
        # ended (seconds since run()) and how long Spark says it took
        progress = runner.query.recentProgress if runner.query is not None else []
        first = next((q for q in progress if "addBatch" in q["durationMs"]), None)
        if first is not None:
            took_ms = first["durationMs"].get("triggerExecution") or 0
            began = datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00")).timestamp()
            firsts[f"{runner.name}_batch"] = took_ms / 1000
            firsts[f"{runner.name}_done"] = began + took_ms / 1000 - wall0
    store.request_stop(pid, "immediate")
    thread.join(1200)
    jvm.java.lang.System.clearProperty(LINK_SST_FILES)
    StageRunner.warm_resumed_inputs = True
    return {"output": took, **start_phases(driver.step_times), **firsts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="200000,1000000", help="state sizes in keys, comma-separated")
    ap.add_argument("--store", default="rocksdb,hdfs", help="state stores, comma-separated")
    ap.add_argument("--pad", type=int, default=200, help="bytes of padding kept per key")
    ap.add_argument("--batch", type=int, default=20_000, help="rows per micro-batch after the fill")
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between epochs")
    ap.add_argument("--epochs", type=int, default=3, help="epochs after the state is full")
    ap.add_argument("--rounds", type=int, default=2, help="restore / cold start pairs (order alternates)")
    ap.add_argument("--modes", default="link",
                    help="ways to restore, each per round: link (the product's), copy, serial, download")
    ap.add_argument("--placements", default="local",
                    help="where the state lives, comma-separated: local (disk), s3 (a moto server, s3a checkpoints), "
                         "s3-objects (channels and snapshots on S3, Spark's checkpoints on the disk)")
    ap.add_argument("--driver-memory", default="8g")
    ap.add_argument("--conf", type=conf_pair, action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    if not set(modes) <= {"link", "copy", "serial", "download"}:
        ap.error(f"--modes: link, copy, serial and/or download, got {args.modes!r}")
    placements = args.placements.split(",")
    if not set(placements) <= {"local", "s3", "s3-objects"}:
        ap.error(f"--placements: local, s3 and/or s3-objects, got {args.placements!r}")
    # before the session: its S3A settings come from the environment
    s3 = MotoS3() if set(placements) - {"local"} else None
    spark = local_session_builder("arroyo-state-scale", driver_memory=args.driver_memory,
                                  confs={**local_master_conf(), **dict(args.conf)}).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # each rebuild's line: files linked, reused from the live checkpoint and copied, and the time it took
    rebuilt = logging.getLogger("airflow_arroyo.runtime.snapshot")
    rebuilt.setLevel(logging.INFO)
    rebuilt.addHandler(logging.StreamHandler(sys.stdout))
    rows = []
    with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-scale-") as tmp:
        store = EpochStore(pg.dsn)
        store.migrate()
        for keys, kind, placement in ((int(k), kind, placement) for k in args.keys.split(",")
                                      for kind in args.store.split(",") for placement in placements):
            root = tmp if placement == "local" else f"s3://{s3.new_bucket()}"  # type: ignore[union-attr]
            checkpoints = f"{tmp}/checkpoints" if placement == "s3-objects" else None
            filled = fill(spark, store, root, args, keys, kind, checkpoints)
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in [*modes, "cold"]}
            for r in range(args.rounds):
                order = [*modes, "cold"]
                for mode in (order if r % 2 == 0 else order[::-1]):
                    if mode != "cold":
                        runs[mode].append(first_output(spark, store, args, filled["pid"], filled["storage"],
                                                       keys, kind, mode, checkpoints))
                    else:
                        cold_pid = f"cold-{uuid.uuid4().hex[:6]}"
                        runs["cold"].append(first_output(spark, store, args, cold_pid, f"{root}/{cold_pid}",
                                                         keys, kind, None, checkpoints))
            # the next size needs the room (moto holds its objects in memory)
            if checkpoints is not None:
                shutil.rmtree(checkpoints, ignore_errors=True)
            if s3 is not None and placement != "local":
                s3.drop_bucket(root)
            else:
                shutil.rmtree(filled["storage"], ignore_errors=True)
                for folder in Path(tmp).glob("cold-*"):
                    shutil.rmtree(folder, ignore_errors=True)
            cold_s = statistics.median(x["output"] for x in runs["cold"])
            row = {**filled, "keys": keys, "store": kind, "cold_s": cold_s, "runs": runs}
            rows.append(row)
            print(f"{kind:>7} {placement:>10} {keys:>9,} keys: state {row['state_bytes'] / 1e6:,.1f} MB, "
                  f"fill {row['fill_s']:.0f} s,"
                  f" epoch p50 {row['epoch_p50']:.2f} s p99 {row['epoch_p99']:.2f} s, bytes new p50 "
                  f"{row['bytes_new_p50'] / 1e6:,.1f} MB, restored snapshot {row['snapshot_bytes'] / 1e6:,.1f} MB;"
                  " first output: "
                  + "; ".join(f"{'cold start' if m == 'cold' else 'restore (' + m + ')'} "
                              f"{statistics.median(x['output'] for x in v):.1f} s "
                              f"{[round(x['output'], 1) for x in v]}"
                              + ("" if m == "cold" else
                                 f", / cold {statistics.median(x['output'] for x in v) / cold_s:.2f}")
                              for m, v in runs.items()), flush=True)
            # the start's phases, then each query's first micro-batch: how long Spark says it took, and when it
            # ended (seconds since run()); "-" where a phase has no part in that start
            columns = [*PHASES, *(f"{q}_{w}" for q in ("src", "agg", "out") for w in ("batch", "done")), "output"]
            print("    median s          " + "".join(f"{m:>14}" for m in runs), flush=True)
            for c in columns:
                print(f"    {c:<18}" + "".join(
                    f"{statistics.median(xs):>14.2f}" if (xs := [x[c] for x in v if c in x]) else f"{'-':>14}"
                    for v in runs.values()), flush=True)
        store.close()
    spark.stop()
    if s3 is not None:
        s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
