"""A pipeline written the way a user would, over Spark's own file source: two JSON folders (orders and
payments), a stream-stream join on ``id`` (keyed state), an exactly-once Parquet sink. The folders start
empty, so the join's batch 0 runs only once the test drops files in, after the pipeline is running: the
situation of issue 30's finding 1 (an epoch cut while batch 0 runs)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from airflow_arroyo.runtime.pipeline import Pipeline

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

ORDERS_SCHEMA = "id LONG, key STRING, amount LONG"
PAYMENTS_SCHEMA = "id LONG, paid LONG"
SINK = "joined_files"


def pipeline(pipeline_id: str, input_path: str, sink_path: str) -> Pipeline:
    def orders(spark: SparkSession) -> DataFrame:
        return spark.readStream.schema(ORDERS_SCHEMA).option("maxFilesPerTrigger", 1).json(f"{input_path}/orders")

    def payments(spark: SparkSession) -> DataFrame:
        return spark.readStream.schema(PAYMENTS_SCHEMA).option("maxFilesPerTrigger", 1).json(f"{input_path}/payments")

    p = Pipeline(pipeline_id, description="two JSON folders joined on id")
    o = p.source("orders", orders)
    pay = p.source("payments", payments)
    p.stage("joined", lambda a, b: a.join(b, "id"), inputs=[o, pay])
    p.sink(SINK, inputs=["joined"], format="parquet", options={"path": sink_path}, chain=False)
    return p


def order(i: int) -> dict[str, object]:
    return {"id": i, "key": f"k{i % 7}", "amount": i * 3}


def payment(i: int) -> dict[str, object]:
    return {"id": i, "paid": i * 3 + (i % 5)}


def write_file(folder: Path, name: str, rows: Iterable[dict[str, object]]) -> None:
    """One JSON-lines file, appearing whole (Spark's file source skips names starting with '.')."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{name}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, folder / name)


def expected(ids: Iterable[int]) -> list[tuple[object, ...]]:
    """The join, in plain Python: every id with both an order and a payment, in the sink's column order."""
    return sorted((i, f"k{i % 7}", i * 3, i * 3 + (i % 5)) for i in ids)
