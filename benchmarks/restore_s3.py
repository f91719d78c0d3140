"""Restore on S3 vs on a local disk: the same checkpoint captured and restored through each, side by side.

One invocation, one SparkSession (local[2]), one throwaway PostgreSQL, one moto S3 server on 127.0.0.1
(a real S3 API over HTTP; a real S3 bucket has other latencies, so read the S3 column as "an S3 API
through the network stack", not as AWS figures). A stateful aggregation over the deterministic generator
(``--keys`` keys, ``--batches`` micro-batches, default state store) writes its Spark checkpoint to a
local disk once. That checkpoint is then snapshotted as one epoch and restored ``--rounds`` times with
three placements:

* ``local``: snapshot objects and the rebuilt checkpoint on the local disk;
* ``s3 objects``: objects on S3, the checkpoint rebuilt on the local disk (the split a Spark without the
  S3A connector uses: ``--storage-uri s3://... --checkpoint-uri /local/path``);
* ``all on s3``: objects on S3 and the checkpoint rebuilt on S3 (what ``s3a://`` checkpoints would do).

Printed per placement: capture time, restore time (median of the rounds: rebuild with verification +
pointer switch), files and bytes moved by the restore, S3 requests the restore made (counted by the
moto server), and the ratio of each restore time to the local one.

``--latency-ms`` adds that many milliseconds before each object read of the S3 placements (a stand-in for a
region's first-byte latency, which moto on loopback does not have: its answers take about a millisecond).
Each restore runs once with every ``--workers`` setting per round, alternating (objects copied one at a time
against ``SnapshotStore.restore_workers`` at once): the table shows each and their ratio.

    python benchmarks/restore_s3.py                  # about a minute
    python benchmarks/restore_s3.py --keys 200000    # a bigger state
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from airflow_arroyo.core.epochs import CheckpointPolicy, PipelineState
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.snapshot import SnapshotStore
from airflow_arroyo.store import EpochStore


class RequestCounter(logging.Handler):
    """Counts the HTTP requests moto's server logs (one werkzeug log line per request)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:  # noqa: ARG002 - it only counts
        self.count += 1


class SlowReads(FileSystem):
    """``fs`` whose object reads each wait ``delay`` seconds first (the benchmark's stand-in for S3's latency)."""

    def __init__(self, fs: FileSystem, delay: float) -> None:
        self.__dict__.update(fs.__dict__)
        self.delay = delay

    def open_input(self, path: str) -> Any:
        time.sleep(self.delay)  # a simulated network round trip, not a wait for a condition
        return super().open_input(path)


def make_checkpoint(spark: Any, path: Path, keys: int, batches: int) -> None:
    from pyspark.sql import functions as F

    from airflow_arroyo.testing import generator_source

    per_batch = max(keys // 2, 1)
    df = generator_source(spark, seed=1, keys=keys, total_rows=per_batch * batches, rows_per_batch=per_batch)
    agg = df.groupBy("key").agg(F.count("*").alias("n"), F.sum("value").alias("total"))
    q = (agg.writeStream.outputMode("update")
         .foreachBatch(lambda d, _b: d.write.format("noop").mode("overwrite").save())
         .option("checkpointLocation", str(path)).trigger(availableNow=True).start())
    q.awaitTermination(600)
    if q.exception() is not None:
        raise RuntimeError(str(q.exception()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", default="1,8", help="restore_workers settings compared, e.g. 1,8")
    parser.add_argument("--latency-ms", type=float, default=0.0,
                        help="simulated first-byte latency of each S3 object read (0: moto's own)")
    args = parser.parse_args(argv)
    settings = [int(w) for w in args.workers.split(",")]

    import boto3
    from moto.server import ThreadedMotoServer
    from pyspark.sql import SparkSession

    counter = RequestCounter()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False
    werkzeug.addHandler(counter)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    bucket = f"arroyo-bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    spark = (SparkSession.builder.master("local[2]").appName("arroyo-restore-s3")
             .config("spark.sql.shuffle.partitions", "4").config("spark.ui.enabled", "false").getOrCreate())
    try:
        with ThrowawayPostgres() as pg, tempfile.TemporaryDirectory(prefix="arroyo-bench-") as tmp:
            source = Path(tmp) / "source-checkpoint"
            t0 = time.monotonic()
            make_checkpoint(spark, source, args.keys, args.batches)
            print(f"checkpoint of {args.keys} keys, {args.batches} batches written in {time.monotonic() - t0:.1f}s")
            store = EpochStore(pg.create_database("bench"))
            store.migrate()
            placements = {
                "local": (f"{tmp}/storage", None),
                "s3 objects": (f"s3://{bucket}/objects-only", f"{tmp}/checkpoints"),
                "all on s3": (f"s3://{bucket}/everything", None),
            }
            rows = []
            for name, (storage_uri, checkpoint_uri) in placements.items():
                pid = f"bench-{uuid.uuid4().hex[:6]}"
                store.register_pipeline(pid, stages=["agg"], run_id="r1", storage_uri=storage_uri)
                store.set_pipeline_state(pid, PipelineState.RUNNING)
                storage = FileSystem.from_uri(storage_uri)
                if args.latency_ms and storage.is_s3:
                    storage = SlowReads(storage, args.latency_ms / 1000)
                checkpoints = FileSystem.from_uri(checkpoint_uri) if checkpoint_uri else storage
                snaps = SnapshotStore(storage, pid, store, checkpoints=checkpoints)
                # the pipeline's live checkpoint: Spark's folder, copied to where this placement keeps it
                live = snaps.layout.checkpoint("agg")
                local_source = FileSystem.from_uri(str(source))
                for e in local_source.list_files():
                    checkpoints.write_bytes_atomic(f"{live}/{e.path}", local_source.read_bytes(e.path))
                tick = store.trigger_tick(pid, CheckpointPolicy(interval=1), force=True)
                assert tick.started is not None
                epoch = tick.started.epoch
                t0 = time.monotonic()
                captured = snaps.capture("agg", epoch, live, args.batches - 1)
                capture_s = time.monotonic() - t0
                store.ack_epoch(pid, epoch, "agg", bytes_new=captured.bytes_new, bytes_total=captured.bytes_total)
                times: dict[int, list[float]] = {w: [] for w in settings}
                requests = []
                for r in range(args.rounds):
                    for w in settings if r % 2 == 0 else list(reversed(settings)):
                        snaps.restore_workers = w
                        before = counter.count
                        t0 = time.monotonic()
                        prepared = snaps.prepare_restore("agg", epoch)
                        snaps.commit_restore(prepared)
                        times[w].append(time.monotonic() - t0)
                        requests.append(counter.count - before)
                rows.append((name, capture_s, {w: statistics.median(ts) for w, ts in times.items()}, prepared.files,
                             prepared.bytes, statistics.median(requests)))
            base = rows[0][2][settings[0]]
            heads = "".join(f"{f'restore s ({w})':>16}" for w in settings)
            print(f"\n{'placement':<12} {'capture s':>10}{heads} {'files':>7} {'bytes moved':>12} "
                  f"{'S3 requests':>12} {'vs local (' + str(settings[0]) + ')':>16} "
                  f"{f'({settings[0]}) / ({settings[-1]})':>12}")
            for name, cap, rest, files, nbytes, reqs in rows:
                cols = "".join(f"{rest[w]:>16.2f}" for w in settings)
                print(f"{name:<12} {cap:>10.2f}{cols} {files:>7} {nbytes:>12} {reqs:>12.0f} "
                      f"{rest[settings[0]] / base:>15.1f}x {rest[settings[0]] / rest[settings[-1]]:>11.2f}x")
    finally:
        spark.stop()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
