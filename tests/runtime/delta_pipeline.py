"""A pipeline writing a Delta Lake table exactly once: the replayable generator, the exactly-once Delta sink."""

from __future__ import annotations

from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.delta import DeltaTarget
from airflow_arroyo.testing import generator_source

SEED, KEYS = 7, 10
SINK = "table"


def pipeline(pipeline_id: str, table_path: str, rows: int, rows_per_batch: int,
             rows_per_second: int | None = None) -> Pipeline:
    p = Pipeline(pipeline_id, description="generator rows into a Delta table")
    src = p.source("rows", lambda spark: generator_source(spark, seed=SEED, keys=KEYS, rows_per_batch=rows_per_batch,
                                                          total_rows=rows, rows_per_second=rows_per_second))
    p.sink(SINK, inputs=[src], transform=lambda df: df.select("id", "key", "value"), table=DeltaTarget(table_path))
    return p
