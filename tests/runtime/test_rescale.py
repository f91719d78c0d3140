"""Rescale on restore (issue 32, deliverable 3) on real Spark: a RocksDB aggregation restored into 8 state
partitions, then into 2, while input flows; the PostgreSQL table it upserts ends with exactly the counts plain
Python gives (state lost or doubled by a rescale would show in them). The run on 8 partitions is a driver process of
its own, SIGKILLed (its JVM with it) at a random moment after it completed an epoch; the restore into 2 is first
SIGKILLed right after its rewrite, before the commit point, then retried."""

from __future__ import annotations

import functools
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg2
import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.rescale import checkpoint_partitions
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import (
    SINK_DSN_ENV,
    Driver,
    epoch_objects,
    kill_at_random_after_an_epoch,
    kill_seed,
    restore_killed_at,
)

pytestmark = [pytest.mark.spark]

ROWS = 1500  # a run's first batch reads what its source's pace made exist since its reader started
KEYS = 20


def counts(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % KEYS).alias("k")).agg(F.count(F.lit(1)).alias("n"))


def pipeline(pipeline_id: str, table: str, rate: int = 20) -> Pipeline:
    """The driver's ``--pipeline tests.runtime.test_rescale:pipeline``; the sink's DSN is in ``SINK_DSN_ENV``;
    ``rate``: the source's rows per second (a run's pace, not part of its state)."""
    p = Pipeline(pipeline_id, chaining=False)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=ROWS, rows_per_second=rate,
                                                          partitions=1).select("id"))
    agg = p.stage("counts", counts, [src], output_mode="update", state_store="rocksdb",
                  spark_conf={"spark.sql.shuffle.partitions": "4"})
    p.sink("out", [agg], postgres=PostgresTarget(table=table, dsn_env=SINK_DSN_ENV, mode="upsert", key=("k",)))
    return p


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
        spark: Any, module_store: EpochStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = kill_seed()
    pid = f"rescale-{uuid.uuid4().hex[:6]}"
    table = f"counts_{uuid.uuid4().hex[:8]}"
    dsn = module_store.dsn
    create_counts_table(dsn, table)
    monkeypatch.setenv(SINK_DSN_ENV, dsn)  # the in-process runs' sink; the processes get it in their environment
    storage = tmp_path / "storage"
    logs = tmp_path / "logs"
    logs.mkdir()
    layout = StorageLayout.at(str(storage), pid)
    src = layout.channel_uri("src")

    def partitions() -> int | None:
        return checkpoint_partitions(layout.checkpoint_fs, layout.checkpoint("counts")).partitions

    def start(*options: str, run_id: str, kill_at_step: str | None = None) -> Driver:
        # slower than the runs in this process: the generator's rows exist from its reader's start, which may come
        # long before the first epoch on a loaded machine, and input must be left for the rescaled run after it
        return Driver(dsn=dsn, storage=storage, pipeline_id=pid, run_id=run_id, logs=logs,
                      pipeline="tests.runtime.test_rescale:pipeline", args={"table": table, "rate": 5},
                      env={SINK_DSN_ENV: dsn}, options=options, kill_at_step=kill_at_step)

    first = DriverThread(PipelineDriver(pipeline(pid, table), module_store, storage_uri=str(storage),
                                        spark=spark)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: first.error or (first.driver.started.is_set() and channel_row_count(src) >= 100),
                 timeout=240, what="100 rows read")
    module_store.request_stop(pid, "graceful")  # a final epoch: the next run restores it
    assert first.join(240).state is PipelineState.STOPPED
    assert partitions() == 4
    # a stage the restore does not rebuild, or a restore that rebuilds nothing, is refused before anything is written
    with pytest.raises(ConfigurationError, match="rescale= names nope"):
        PipelineDriver(pipeline(pid, table), module_store, storage_uri=str(storage), spark=spark,
                       restore_from="latest", rescale={"nope": 8}).run()

    with CheckpointTicker(module_store, pid, interval=1.0):
        # 4 -> 8 in a process of its own, SIGKILLed at a random moment after it completed an epoch
        read = channel_row_count(src)
        cut = kill_at_random_after_an_epoch(start("--rescale", "counts=8", run_id="up"), module_store, pid, rng,
                                            also=lambda: channel_row_count(src) >= read + 20).epoch
        assert partitions() == 8
        barrier = Channel.open(src).find_barrier(cut)
        assert barrier is not None and len(Channel.open(src).read_table(end=barrier)) < ROWS  # input is left
        objects = epoch_objects(module_store, storage, pid, cut)

        # 8 -> 2: the first restore is SIGKILLed right after the rewrite, before the commit point: the live
        # checkpoint and the store are as they were
        restore_killed_at("rescaled:counts", functools.partial(start, "--rescale", "counts=2"), "down-killed")
        assert partitions() == 8
        assert module_store.latest_completed_epoch(pid).epoch == cut

        # the retry, in this process, to the end of the input
        expected = dict(Counter(i % KEYS for i in range(ROWS)))
        down = DriverThread(PipelineDriver(pipeline(pid, table, rate=300), module_store, storage_uri=str(storage),
                                           spark=spark, restore_from="latest", rescale={"counts": 2},
                                           takeover=True)).start()
        # running first: a stop asked before the run registers is not its own (registering clears it)
        wait_for(lambda: down.error or (down.driver.started.is_set() and table_counts(dsn, table) == expected),
                 timeout=240, what="every row counted")
    module_store.request_stop(pid, "graceful")
    result = down.join(240)
    assert result.state is PipelineState.STOPPED and result.restored_from_epoch == cut
    assert partitions() == 2
    state = layout.checkpoint_fs.list_dir(f"{layout.checkpoint('counts')}/state/0")
    assert sorted(int(e.name) for e in state if e.is_dir and e.name.isdigit()) == [0, 1]  # none left of 8
    assert table_counts(dsn, table) == expected  # the final epoch committed every count
    assert epoch_objects(module_store, storage, pid, cut) == objects  # the restores only read the epoch's objects
