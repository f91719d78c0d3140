"""The demo pipeline: two replayable generator sources, a keyed two-input stage, a downstream stage.

::

    left  (generator, seed 1) ─┐
                               ├─> joined (stream-stream join on id: keyed state) ─> report (channel)
    right (generator, seed 2) ─┘

Every row id appears once on each side, so ``joined`` emits each id exactly once whatever the
micro-batch boundaries are, and ``report`` keeps the rows whose total is not a multiple of 7. The final
channel's content is therefore independent of batching, restores and timing: exactly what the
exactly-once proof compares with :func:`expected_report` (plain Python over the generator's rows).

Run it with the driver::

    ARROYO_DSN=postgresql://... python -m airflow_arroyo.runtime.driver \\
        --pipeline airflow_arroyo.examples.pipelines:demo --storage-uri /tmp/arroyo --master 'local[2]' \\
        --arg rows=20000
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from airflow_arroyo.runtime.generator import generate_rows, generator_source
from airflow_arroyo.runtime.pipeline import Pipeline

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["OUTPUT_CHANNEL", "demo", "expected_report"]

OUTPUT_CHANNEL = "report"
LEFT_SEED = 1
RIGHT_SEED = 2


def demo(
    pipeline_id: str = "arroyo-demo",
    rows: int | None = 20_000,
    rows_per_batch: int = 1_000,
    keys: int = 100,
    state_store: Literal["hdfs", "rocksdb"] | None = None,
    trigger_interval: float | None = None,
    partitions: int = 2,
) -> Pipeline:
    """The demo pipeline. ``rows=None`` makes the generators unbounded (benchmarks); ``rows_per_batch``
    paces them (rows per micro-batch of each source)."""

    def left(spark: SparkSession) -> DataFrame:
        df = generator_source(spark, seed=LEFT_SEED, keys=keys, total_rows=rows, rows_per_batch=rows_per_batch,
                              partitions=partitions)
        return df.selectExpr("id", "key", "value AS left_value")

    def right(spark: SparkSession) -> DataFrame:
        df = generator_source(spark, seed=RIGHT_SEED, keys=keys, total_rows=rows, rows_per_batch=rows_per_batch,
                              partitions=partitions)
        return df.selectExpr("id", "value AS right_value")

    def join(lhs: DataFrame, rhs: DataFrame) -> DataFrame:
        return lhs.join(rhs, "id")  # stream-stream inner join: both sides kept in keyed state

    def report(joined: DataFrame) -> DataFrame:
        return (joined.selectExpr("id", "key", "left_value", "right_value", "left_value + right_value AS total")
                .where("total % 7 <> 0"))

    p = Pipeline(pipeline_id, description="two generators, a stream-stream join, a filter")
    lhs = p.source("left", left, trigger_interval=trigger_interval)
    rhs = p.source("right", right, trigger_interval=trigger_interval)
    joined = p.stage("joined", join, inputs=[lhs, rhs], state_store=state_store, trigger_interval=trigger_interval)
    p.stage(OUTPUT_CHANNEL, report, inputs=[joined], trigger_interval=trigger_interval)
    return p


def expected_report(rows: int, keys: int = 100) -> list[tuple[int, str, int, int, int]]:
    """The demo's final output computed in plain Python, sorted by id."""
    lhs = generate_rows(LEFT_SEED, 0, rows, keys).to_pydict()
    rhs = generate_rows(RIGHT_SEED, 0, rows, keys).to_pydict()
    right_value = dict(zip(rhs["id"], rhs["value"], strict=True))
    out = []
    for i, k, lv in zip(lhs["id"], lhs["key"], lhs["value"], strict=True):
        rv = right_value[i]
        if (lv + rv) % 7 != 0:
            out.append((i, k, lv, rv, lv + rv))
    return sorted(out)
