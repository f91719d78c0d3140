"""What does exactly-once cost when writing PostgreSQL? The same rows, side by side in one run.

* **exactly-once**: :class:`~airflow_arroyo.runtime.sinks.postgres.TransactionalPostgresSink` in append or upsert
  mode: each micro-batch staged from the executors, committed into the table every ``--batches-per-epoch``
  batches (one transaction per epoch), as the driver does when an epoch completes;
* **plain**: what a Structured Streaming user writes with ``foreachBatch``: every partition inserts (or
  ``INSERT ... ON CONFLICT DO UPDATE``) straight into the table with psycopg2's ``execute_values``, one
  transaction per partition; at-least-once across a restore.

One SparkSession (local[2]), one throwaway PostgreSQL; rounds alternate the order (ABBA). Prints rows/s of
each and the ratio exactly-once / plain per mode.

    python benchmarks/pg_sink.py                       # about 2 minutes
    python benchmarks/pg_sink.py --rows 200000 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)

import psycopg2
import psycopg2.extras

from airflow_arroyo.devtools.postgres import ThrowawayPostgres
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget, TransactionalPostgresSink

SCHEMA = "id BIGINT, key STRING, amount BIGINT"
DDL = {
    "append": "CREATE TABLE {t} (id bigint NOT NULL, key text NOT NULL, amount bigint)",
    "upsert": "CREATE TABLE {t} (key text PRIMARY KEY, id bigint, amount bigint)",
}


def execute(dsn: str, query: str) -> Any:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchone() if cur.description else None
    finally:
        conn.close()


class PlainWriter:
    """The ``foreachBatch`` body a user would write: insert each partition straight into the table."""

    def __init__(self, dsn: str, table: str, mode: str) -> None:
        self.dsn = dsn
        conflict = " ON CONFLICT (key) DO UPDATE SET id = EXCLUDED.id, amount = EXCLUDED.amount" if mode == "upsert" \
            else ""
        self.insert = f"INSERT INTO {table} (id, key, amount) VALUES %s{conflict}"  # noqa: S608 - benchmark's own name

    def __call__(self, rows: Iterable[Any]) -> None:
        values = [tuple(r) for r in rows]
        if not values:
            return
        conn = psycopg2.connect(self.dsn)
        try:
            with conn, conn.cursor() as cur:
                psycopg2.extras.execute_values(cur, self.insert, values, page_size=1000)
        finally:
            conn.close()


def batches(spark: Any, rows: int, per_batch: int, keys: int, mode: str) -> list[Any]:
    """Cached DataFrames of the micro-batches (generated once; the timed part is the writing)."""
    out = []
    for start in range(0, rows, per_batch):
        end = min(rows, start + per_batch)
        df = spark.range(start, end, numPartitions=2).selectExpr(
            "id", f"concat('k', CAST(id % {keys} AS STRING)) AS key", "id * 7 % 1000 AS amount")
        if mode == "upsert":  # update output mode: one row per key per batch
            df = df.groupBy("key").agg({"id": "max", "amount": "sum"}).selectExpr(
                "`max(id)` AS id", "key", "`sum(amount)` AS amount").repartition(2)
        out.append(df.cache())
        out[-1].count()
    return out


def run_exactly_once(dsn: str, table: str, mode: str, dfs: list[Any], per_epoch: int, run: int) -> None:
    target = PostgresTarget(table=table, dsn=dsn, mode=mode, key=("key",) if mode == "upsert" else ())  # type: ignore[arg-type]
    sink = TransactionalPostgresSink(f"bench-{run}", "sink", target)
    sink.check_writable()
    sink.claim()
    for b, df in enumerate(dfs):
        sink.write_batch(df, b)
        if (b + 1) % per_epoch == 0 or b == len(dfs) - 1:
            sink.commit_through(b)
            sink.trim_through(b)  # retention keeps the latest epoch only here


def run_plain(dsn: str, table: str, mode: str, dfs: list[Any]) -> None:
    writer = PlainWriter(dsn, table, mode)
    for df in dfs:
        df.foreachPartition(writer)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rows-per-batch", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=5_000, help="distinct keys (upsert)")
    parser.add_argument("--batches-per-epoch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("pg-sink-benchmark")
             .config("spark.sql.shuffle.partitions", "2").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="arroyo-pgsink-bench-") as tmp, ThrowawayPostgres(base_dir=tmp) as pg:
        dsn = pg.create_database("bench")
        run = 0
        for mode in ("append", "upsert"):
            dfs = batches(spark, args.rows, args.rows_per_batch, args.keys, mode)
            n_rows = sum(df.count() for df in dfs)
            per: dict[str, list[float]] = {"exactly-once": [], "plain": []}
            for r in range(args.rounds):
                order = ["exactly-once", "plain"] if r % 2 == 0 else ["plain", "exactly-once"]
                for variant in order:
                    run += 1
                    table = f"t{run}"
                    execute(dsn, DDL[mode].format(t=table))
                    t0 = time.perf_counter()
                    if variant == "exactly-once":
                        run_exactly_once(dsn, table, mode, dfs, args.batches_per_epoch, run)
                    else:
                        run_plain(dsn, table, mode, dfs)
                    seconds = time.perf_counter() - t0
                    count = execute(dsn, f"SELECT count(*) FROM {table}")[0]  # noqa: S608
                    expected = n_rows if mode == "append" else min(args.keys, args.rows)
                    assert count == expected, f"{variant} {mode}: {count} rows in the table, expected {expected}"
                    per[variant].append(n_rows / seconds)
            results[mode] = per
            for df in dfs:
                df.unpersist()
    spark.stop()
    summary = {
        mode: {
            "rows_per_s_exactly_once": [round(v) for v in per["exactly-once"]],
            "rows_per_s_plain": [round(v) for v in per["plain"]],
            "ratio": round(sum(per["exactly-once"]) / sum(per["plain"]), 3),
        }
        for mode, per in results.items()
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return
    print(f"rows={args.rows} rows/batch={args.rows_per_batch} batches/epoch={args.batches_per_epoch} "
          f"rounds={args.rounds} (ABBA)")
    for mode, s in summary.items():
        print(f"{mode:7s} exactly-once {s['rows_per_s_exactly_once']} rows/s | plain foreachBatch "
              f"{s['rows_per_s_plain']} rows/s | ratio {s['ratio']}")


if __name__ == "__main__":
    main()
