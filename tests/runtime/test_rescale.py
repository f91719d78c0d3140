"""Rescale on restore (issue 32, deliverable 3) on real Spark: a RocksDB aggregation restored into 8 state
partitions, then into 2, while input flows; the PostgreSQL table it upserts ends with exactly the counts plain
Python gives (state lost or doubled by a rescale would show in them)."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.rescale import checkpoint_partitions
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import interrupted_restore

pytestmark = [pytest.mark.spark]

ROWS = 600
KEYS = 20


def counts(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % KEYS).alias("k")).agg(F.count(F.lit(1)).alias("n"))


def pipeline(pid: str, dsn: str, table: str) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=ROWS, rows_per_second=60,
                                                          partitions=1).select("id"))
    agg = p.stage("counts", counts, [src], output_mode="update", state_store="rocksdb",
                  spark_conf={"spark.sql.shuffle.partitions": "4"})
    p.sink("out", [agg], postgres=PostgresTarget(table=table, dsn=dsn, mode="upsert", key=("k",)))
    return p


def _hooked(driver: PipelineDriver, hook: Any) -> PipelineDriver:
    driver.on_step = hook
    return driver


def table_counts(dsn: str, table: str) -> dict[int, int]:
    conn = psycopg2.connect(dsn)
    try:
        with conn, conn.cursor() as cur:
            cur.execute(f"SELECT k, n FROM {table}")  # noqa: S608 - the test's own table
            return {int(k): int(n) for k, n in cur.fetchall()}
    finally:
        conn.close()


def create_counts_table(dsn: str, table: str) -> None:
    """The upserted (k, n) table of a counting pipeline (sinks never create tables)."""
    conn = psycopg2.connect(dsn)
    with conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {table} (k bigint PRIMARY KEY, n bigint NOT NULL)")
    conn.close()


def test_a_restore_rescales_an_aggregations_state_4_to_8_to_2_with_exact_counts(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"rescale-{uuid.uuid4().hex[:6]}"
    table = f"counts_{uuid.uuid4().hex[:8]}"
    dsn = module_store.dsn
    create_counts_table(dsn, table)
    storage = str(tmp_path / "storage")
    layout = StorageLayout.at(storage, pid)
    src = layout.channel_uri("src")

    def run(rows: int, **kwargs: Any) -> Any:
        driver = PipelineDriver(pipeline(pid, dsn, table), module_store, storage_uri=storage, spark=spark, **kwargs)
        thread = DriverThread(driver).start()
        with CheckpointTicker(module_store, pid, interval=1.0):
            wait_for(lambda: thread.error or (driver.started.is_set() and channel_row_count(src) >= rows),
                     timeout=240, what=f"{rows} rows read")
        module_store.request_stop(pid, "graceful")  # a final epoch: the next run restores it
        return thread.join(240)

    def partitions() -> int | None:
        return checkpoint_partitions(layout.checkpoint_fs, layout.checkpoint("counts")).partitions

    assert run(ROWS // 3).state is PipelineState.STOPPED
    assert partitions() == 4
    # a stage the restore does not rebuild, or a restore that rebuilds nothing, is refused before anything is written
    with pytest.raises(ConfigurationError, match="rescale= names nope"):
        PipelineDriver(pipeline(pid, dsn, table), module_store, storage_uri=storage, spark=spark,
                       restore_from="latest", rescale={"nope": 8}).run()

    # a kill right after the rewrite, before the commit point: the live checkpoint and the store are as they were
    latest = module_store.latest_completed_epoch(pid)

    def look() -> None:
        assert partitions() == 4
        assert module_store.latest_completed_epoch(pid) == latest

    interrupted_restore(lambda run_id, hook: _hooked(PipelineDriver(
        pipeline(pid, dsn, table), module_store, storage_uri=storage, spark=spark, restore_from="latest",
        rescale={"counts": 8}, run_id=run_id), hook), "rescaled:counts", "kill", look)

    up = run(2 * ROWS // 3, restore_from="latest", rescale={"counts": 8})
    assert up.state is PipelineState.STOPPED and up.restored_from_epoch is not None
    assert partitions() == 8
    down = run(ROWS, restore_from="latest", rescale={"counts": 2})
    assert down.state is PipelineState.STOPPED
    assert partitions() == 2
    state = layout.checkpoint_fs.list_dir(f"{layout.checkpoint('counts')}/state/0")
    assert sorted(int(e.name) for e in state if e.is_dir and e.name.isdigit()) == [0, 1]  # none left of 8
    expected = Counter(i % KEYS for i in range(ROWS))
    assert table_counts(dsn, table) == dict(expected)  # the final epoch committed every count
