"""Python workers over a Unix domain socket against loopback TCP: what a channel's reader pays per micro-batch.

Spark's JVM talks to each Python task (a Python data source's read, such as a channel's, a ``mapInArrow``, a
pandas UDF) through a Python worker; over loopback TCP, Spark's default, each such task took ~40 ms more on
this machine than over a Unix domain socket (``spark.python.unix.domain.socket.enabled``, Spark 4.1+), which
:func:`airflow_arroyo.jvm.local_master_conf` now turns on for every application the provider starts on a
``local`` master. The setting is fixed when a JVM starts, so each run is a process of its own: per round one
with ``false`` (TCP) and one with the provider's confs (the socket), in alternating order, each measuring:

* **the channel reader's micro-batch**, a hop's second half: a streaming query over a channel
  (``read_channel``) whose entries hold ``--rows`` rows each, one entry per batch, with the latency
  benchmark's sink (a ``groupBy`` and a ``collect``) and a stage's checkpoint file manager; medians of
  Spark's ``addBatch`` and ``triggerExecution`` (the whole batch) over ``--batches`` batches after
  ``--warmup`` batches;
* **one Python task alone**: a one-row ``mapInArrow`` collected, median of ``--tasks`` calls, against the same
  collect without Python.

Prints each run, then per measure the median per setting and the ratio socket / TCP, measured side by side.
``--standalone`` runs every session against a Spark standalone cluster on 127.0.0.1 instead (a master and
one worker of 2 cores, each a JVM of its own: ``devtools.spark_cluster``; client mode, as the operator
submits there): the Python tasks then run in the worker's executor.

    python benchmarks/python_workers.py                  # 2 rounds: about 3 minutes
    python benchmarks/python_workers.py --standalone     # the same on a loopback standalone cluster
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import batches_with_rows, local_session_builder, product_confs, use_stage_checkpoint_manager
from latency import count_per_bucket

from airflow_arroyo.jvm import PYTHON_WORKER_SOCKET_CONF

SETTINGS = {"tcp": "false", "socket": "true"}
MEASURES = ("reader addBatch", "reader batch", "python task", "same collect without python")


def _channel(uri: str, entries: int, rows: int) -> None:
    import pyarrow as pa

    from airflow_arroyo.runtime.channel import Channel

    schema = pa.schema([("id", pa.int64()), ("key", pa.int64()), ("ts", pa.timestamp("us", tz="UTC")),
                        ("total", pa.int64())])
    channel = Channel.create(uri, schema)
    start = int(time.time() * 1e6)
    for i in range(entries):
        ids = pa.array(range(i * rows, (i + 1) * rows), pa.int64())
        table = pa.table({"id": ids, "key": pa.array([x % 100 for x in range(rows)], pa.int64()),
                          "ts": pa.array([start + x * 50 for x in range(rows)], pa.timestamp("us", tz="UTC")),
                          "total": ids}, schema=schema)
        channel.append_table(table, i, "bench")


def _sink(df: Any, batch_id: int) -> None:  # noqa: ARG001 - foreach_batch's signature
    count_per_bucket(df)


def run_in_child(out: Any, setting: str, rows: int, warmup: int, batches: int, tasks: int,
                 master: str = "local[2]") -> None:
    """One run in a JVM of its own; the medians (ms) or the error's text go back through ``out``."""
    try:
        confs = product_confs({PYTHON_WORKER_SOCKET_CONF: SETTINGS[setting]})
        spark = local_session_builder("arroyo-python-workers", master=master, confs=confs).getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        from airflow_arroyo.runtime.sources import read_channel

        use_stage_checkpoint_manager(spark)

        with tempfile.TemporaryDirectory(prefix="arroyo-pyworkers-") as tmp:
            uri = Path(tmp, "channel").as_uri()
            _channel(uri, warmup + batches, rows)
            query = (read_channel(spark, uri, max_files_per_batch=1).writeStream.foreachBatch(_sink)
                     .option("checkpointLocation", f"{tmp}/checkpoint").trigger(processingTime="0 seconds").start())
            measured = batches_with_rows(query, warmup + batches)[warmup:warmup + batches]
            result = {"reader addBatch": statistics.median(p["durationMs"]["addBatch"] for p in measured),
                      "reader batch": statistics.median(p["durationMs"]["triggerExecution"] for p in measured)}

            def identity(batches: Any) -> Any:  # nested: shipped by value (a spawned child's module is not importable)
                yield from batches

            df = spark.range(1).repartition(1).cache()
            df.count()
            for name, python in (("python task", True), ("same collect without python", False)):
                times = []
                for _ in range(tasks + 3):
                    t0 = time.perf_counter()
                    (df.mapInArrow(identity, df.schema) if python else df).collect()
                    times.append((time.perf_counter() - t0) * 1000)
                result[name] = statistics.median(times[3:])
        spark.stop()
        out.put(result)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put(f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds (a round = one TCP run, one socket run)")
    parser.add_argument("--rows", type=int, default=34_000,
                        help="rows per channel entry (34,000: a 1.7 s batch of latency.py at 20,000 rows/s)")
    parser.add_argument("--warmup", type=int, default=5, help="reader batches left out")
    parser.add_argument("--batches", type=int, default=15, help="reader batches measured")
    parser.add_argument("--tasks", type=int, default=25, help="one-row Python tasks timed")
    parser.add_argument("--standalone", action="store_true",
                        help="run against a standalone cluster on 127.0.0.1 (a master, one worker of 2 cores)")
    args = parser.parse_args(argv)
    with contextlib.ExitStack() as stack:
        master = "local[2]"
        if args.standalone:
            from airflow_arroyo.devtools.spark_cluster import StandaloneCluster

            cluster = StandaloneCluster(workers=1, cores=2)
            cluster.start()
            stack.callback(cluster.stop)
            master = cluster.master_url
        return _rounds(args, master)


def _rounds(args: argparse.Namespace, master: str) -> int:
    print(f"{args.rounds} round(s), {master}, a driver JVM per run; reader: {args.rows:,} rows per entry, "
          f"{args.batches} batches after {args.warmup}; {args.tasks} one-row Python tasks", flush=True)
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for i in range(args.rounds):
        for setting in list(SETTINGS) if i % 2 == 0 else list(SETTINGS)[::-1]:
            out = ctx.Queue()
            child = ctx.Process(target=run_in_child, args=(out, setting, args.rows, args.warmup, args.batches,
                                                           args.tasks, master))
            child.start()
            got = out.get(timeout=900)
            child.join(120)
            if isinstance(got, str):
                raise SystemExit(f"the {setting} run failed: {got}")
            runs[setting].append(got)
            print(f"  round {i + 1} {setting:6s}: " + ", ".join(f"{m} {got[m]:6.1f} ms" for m in MEASURES),
                  flush=True)
    print("\nmedian over rounds, ms: TCP / socket (ratio socket / TCP):")
    for m in MEASURES:
        tcp, sock = (statistics.median(r[m] for r in runs[s]) for s in ("tcp", "socket"))
        print(f"  {m:28s} {tcp:7.1f} / {sock:7.1f}  ({sock / tcp:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
