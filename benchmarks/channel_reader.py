"""A channel's reader against Spark's own file source over the same Parquet files: what a hop's second half
costs beyond a Spark micro-batch.

A channel keeps its rows in Parquet files (docs/channel-format.md), one folder per entry, and a stage reads it
through a Python data source (``read_channel``). Spark's own file source (``spark.readStream.parquet``) can read
the same files, without the channel's rules (barriers, caps, fencing): the cheapest micro-batch a reader over
those files could have in Spark. Per round, in one session (``local[2]``, the stages' checkpoint file manager,
the driver's local confs: ``airflow_arroyo.jvm.local_master_conf``), each side in turn (alternating order)
reads a channel of ``--warmup + --batches`` entries of ``--rows`` rows, one entry per micro-batch, into the
latency benchmark's sink (a ``groupBy`` and a ``collect``: ``latency.count_per_bucket``), after one run of each
side that is not measured (the session's first runs are slower: the JVM warms up); per side, the
medians over the measured batches of Spark's ``addBatch`` and ``triggerExecution`` (the whole batch) and of
the sink's own job (building the DataFrame and its ``collect``, timed in the sink).

Prints each run, then per measure the median over rounds per side and the ratio channel / file source.

    python benchmarks/channel_reader.py                     # 4 rounds: about 75 seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

from _spark import batches_with_rows, local_session_builder, product_confs, use_stage_checkpoint_manager
from latency import count_per_bucket
from python_workers import _channel

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

SIDES = ("channel", "file source")
MEASURES = ("addBatch", "triggerExecution", "sink job")


def run_side(spark: SparkSession, side: str, tmp: Path, rows: int, warmup: int, batches: int) -> dict[str, float]:
    """One reader over a fresh channel of ``warmup + batches`` entries; medians (ms) of the measured batches."""
    from airflow_arroyo.runtime.sources import read_channel

    folder = tmp / f"{side.replace(' ', '-')}-{time.monotonic_ns()}"
    _channel(folder.joinpath("channel").as_uri(), warmup + batches, rows)
    if side == "channel":
        df = read_channel(spark, folder.joinpath("channel").as_uri(), max_files_per_batch=1)
    else:  # the same files: an entry's folder holds its part files
        pattern = str(folder / "channel" / "data" / "*")
        df = spark.readStream.schema(spark.read.parquet(pattern).schema).option("maxFilesPerTrigger", 1).parquet(
            pattern)
    sink_ms: list[float] = []

    def sink(batch: DataFrame, batch_id: int) -> None:  # noqa: ARG001 - foreach_batch's signature
        t0 = time.perf_counter()
        count_per_bucket(batch)
        sink_ms.append((time.perf_counter() - t0) * 1000)

    query = (df.writeStream.foreachBatch(sink).option("checkpointLocation", str(folder / "checkpoint"))
             .trigger(processingTime="0 seconds").start())
    measured = batches_with_rows(query, warmup + batches)[warmup:warmup + batches]
    return {"addBatch": statistics.median(p["durationMs"]["addBatch"] for p in measured),
            "triggerExecution": statistics.median(p["durationMs"]["triggerExecution"] for p in measured),
            "sink job": statistics.median(sink_ms[warmup:warmup + batches])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="rounds (a round = one run of each side)")
    parser.add_argument("--rows", type=int, default=17_000,
                        help="rows per entry (17,000: a batch of latency.py's boundary at 20,000 rows/s)")
    parser.add_argument("--warmup", type=int, default=8, help="batches left out per run")
    parser.add_argument("--batches", type=int, default=20, help="batches measured per run")
    args = parser.parse_args(argv)
    spark = local_session_builder("arroyo-channel-reader", confs=product_confs({})).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    use_stage_checkpoint_manager(spark)
    print(f"{args.rounds} round(s), local[2], one session; {args.rows:,} rows per entry, one entry per batch, "
          f"{args.batches} batches measured after {args.warmup}", flush=True)
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    with tempfile.TemporaryDirectory(prefix="arroyo-channel-reader-") as tmp:
        for side in SIDES:  # not measured: the session's first runs pay for the JVM's warm-up (JIT, classes)
            run_side(spark, side, Path(tmp), args.rows, args.warmup, args.batches)
        for i in range(args.rounds):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                got = run_side(spark, side, Path(tmp), args.rows, args.warmup, args.batches)
                runs[side].append(got)
                print(f"  round {i + 1} {side:11s}: " + ", ".join(f"{m} {got[m]:6.1f} ms" for m in MEASURES),
                      flush=True)
    spark.stop()
    print("\nmedian over rounds, ms: channel / file source (ratio channel / file source):")
    for m in MEASURES:
        channel, files = (statistics.median(r[m] for r in runs[s]) for s in SIDES)
        print(f"  {m:18s} {channel:7.1f} / {files:7.1f}  ({channel / files:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
