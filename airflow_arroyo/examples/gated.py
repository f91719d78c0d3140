"""The gated example pipeline: orders from a replayable generator into a PostgreSQL table through a commit gate.

::

    orders (generator) ─> orders_pg (exactly-once PostgreSQL sink, gate=Gate(policy="hold", timeout=600))

Each epoch's orders wait in the sink's pending table until a verdict passes them
(``dags/example_gate_check.py`` checks each epoch as its gate opens); only then do they reach the table. The sink
writes into the database of ``dsn_env`` (default ``ARROYO_DSN``, which the submit operator hands every driver: the
epoch store's own database, so the example needs no other database). Airflow-free, like every pipeline module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_arroyo.core.gates import Gate
from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_SINK, GATED_TABLE
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.testing import generator_source

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["ORDERS_DDL", "gated_orders"]

#: The target table ({table}: its name); sinks never create tables.
ORDERS_DDL = ("CREATE TABLE IF NOT EXISTS {table} (order_id bigint NOT NULL, customer text NOT NULL, "
              "amount bigint NOT NULL)")


def gated_orders(
    pipeline_id: str = GATED_PIPELINE_ID,
    rows: int | None = 5_000,
    rows_per_batch: int = 500,
    trigger_interval: float | None = 1.0,
    table: str = GATED_TABLE,
    dsn_env: str = "ARROYO_DSN",
    policy: str = "hold",
    timeout: float | None = 600.0,
) -> Pipeline:
    """Orders (``order_id``, ``customer``, ``amount``) into ``table``, each epoch's behind a gate of ``policy``
    (``hold`` or ``rollback_and_stop``: a PostgreSQL sink) with a verdict due within ``timeout`` seconds."""

    def orders(spark: SparkSession) -> DataFrame:
        df = generator_source(spark, seed=3, keys=50, total_rows=rows, rows_per_batch=rows_per_batch, partitions=1)
        return df.selectExpr("id AS order_id", "key AS customer", "value AS amount")

    p = Pipeline(pipeline_id, description="generated orders into PostgreSQL through a commit gate")
    src = p.source("orders", orders, trigger_interval=trigger_interval)
    p.sink(GATED_SINK, [src], trigger_interval=trigger_interval,
           postgres=PostgresTarget(table=table, dsn_env=dsn_env, mode="append"),
           gate=Gate(policy=policy, timeout=timeout))
    return p
