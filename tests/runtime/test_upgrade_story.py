"""Issue 32's proof on real Spark: one run of a pipeline shaped like the example (a generator source whose input
keeps flowing, a RocksDB aggregation, exactly-once sinks) upgraded twice and rescaled once, with a restore killed
on the way, exact at the end against plain Python.

v1 (src -> counts -> PostgreSQL upsert) is upgraded in one step while it runs to v2: the aggregation renamed under
a stable uid (its state kept) and a new branch (even ids to files, starting at the final epoch's cut). v2 is
restored into 8 state partitions (a first attempt killed after the rewrite, before the commit point), then
upgraded to v3, a compatible change (a stateless filter before the aggregation, which the driver's state schema
check lets through). The table ends with every key's count over all rows, the files with the even ids after the
first upgrade's cut."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.upgrades import prepare_upgrade
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.layout import StorageLayout
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.runtime.rescale import checkpoint_partitions
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, channel_row_count, generator_source, wait_for
from tests.runtime.pipeline_support import interrupted_restore
from tests.runtime.test_rescale import create_counts_table, table_counts
from tests.runtime.test_upgrade_restore import completed_epochs, evens, folder_values

pytestmark = [pytest.mark.spark]

ROWS = 900  # about 22 s of input at 40 rows/s: the upgrades and the rescale come while it flows
KEYS = 20


def counts(df: Any) -> Any:
    from pyspark.sql import functions as F

    return df.groupBy((F.col("id") % KEYS).alias("k")).agg(F.count(F.lit(1)).alias("n"))


def filtered_counts(df: Any) -> Any:
    from pyspark.sql import functions as F

    return counts(df.where(F.col("id") >= 0))


def version(n: int, pid: str, dsn: str, table: str, root: Path) -> Pipeline:
    p = Pipeline(pid, chaining=False)
    src = p.source("src", lambda spark: generator_source(spark, total_rows=ROWS, rows_per_second=40,
                                                          partitions=1).select("id"))
    name, code = {1: ("counts", counts), 2: ("counts_v2", counts), 3: ("counts_v2", filtered_counts)}[n]
    agg = p.stage(name, code, [src], output_mode="update", state_store="rocksdb", output="counts", uid="counts",
                  spark_conf={"spark.sql.shuffle.partitions": "4"})
    p.sink("out", [agg], postgres=PostgresTarget(table=table, dsn=dsn, mode="upsert", key=("k",)))
    if n >= 2:
        even = p.stage("evens", evens, [src])
        p.sink("evens_out", [even], format="json", options={"path": str(root / "evens")})
    return p


def test_the_example_pipeline_upgraded_twice_and_rescaled_once_while_input_flows_is_exact(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"story-{uuid.uuid4().hex[:6]}"
    table = f"story_{uuid.uuid4().hex[:8]}"
    dsn = module_store.dsn
    create_counts_table(dsn, table)
    storage = str(tmp_path / "storage")
    layout = StorageLayout.at(storage, pid)
    src = layout.channel_uri("src")

    def completed() -> int:
        return completed_epochs(module_store, pid)

    def driver(n: int, **kwargs: Any) -> PipelineDriver:
        return PipelineDriver(version(n, pid, dsn, table, tmp_path), module_store, storage_uri=storage, spark=spark,
                              **kwargs)

    def run(n: int, rows: int, **kwargs: Any) -> Any:
        d = driver(n, **kwargs)
        thread = DriverThread(d).start()
        with CheckpointTicker(module_store, pid, interval=1.0):
            wait_for(lambda: thread.error or (d.started.is_set() and channel_row_count(src) >= rows),
                     timeout=240, what=f"{rows} rows read by v{n}")
        module_store.request_stop(pid, "graceful")  # a final epoch: the next run restores it
        return thread.join(240)

    # v1 runs; the upgrade to v2 stops it with a final epoch and pins it, while input flows
    first = DriverThread(driver(1)).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: first.error or (completed() >= 1 and channel_row_count(src) >= ROWS // 10),
                 timeout=240, what="an epoch of v1")
        ready = prepare_upgrade(module_store, pid, version(2, pid, dsn, table, tmp_path).validate(), label="v2",
                                stop_timeout=120)
    assert first.join(240).state is PipelineState.STOPPED
    assert {r.stage: r.action.value for r in ready.plan.stages} == {
        "src": "restored", "counts_v2": "restored", "out": "restored", "evens": "new", "evens_out": "new"}
    channel = Channel.open(src)
    barrier = channel.find_barrier(ready.epoch)
    assert barrier is not None
    before_cut = set(channel.read_table(channel.start_position(), barrier).column("id").to_pylist())
    assert min(before_cut) == 0 and 0 < len(before_cut) < ROWS

    v2 = run(2, 2 * ROWS // 5, restore_from=ready.epoch)
    assert v2.state is PipelineState.STOPPED and v2.restored_from_epoch == ready.epoch

    # rescale 4 -> 8 on a restore; the first attempt is killed after the rewrite, before the commit point
    latest = module_store.latest_completed_epoch(pid)

    def partitions() -> int | None:
        return checkpoint_partitions(layout.checkpoint_fs, layout.checkpoint("counts_v2")).partitions

    def look() -> None:
        assert partitions() == 4
        assert module_store.latest_completed_epoch(pid) == latest

    def hooked(run_id: str, hook: Any) -> PipelineDriver:
        d = driver(2, restore_from="latest", rescale={"counts_v2": 8}, run_id=run_id)
        d.on_step = hook
        return d

    interrupted_restore(hooked, "rescaled:counts_v2", "kill", look)
    up = run(2, 3 * ROWS // 5, restore_from="latest", rescale={"counts_v2": 8})
    assert up.state is PipelineState.STOPPED and partitions() == 8

    # v3: a compatible change of the aggregation's query, restored with its state, to the end of the input
    expected = dict(Counter(i % KEYS for i in range(ROWS)))
    expected_evens = sorted(i for i in range(ROWS) if i % 2 == 0 and i not in before_cut)
    d3 = driver(3, restore_from="latest")
    last = DriverThread(d3).start()
    with CheckpointTicker(module_store, pid, interval=1.0):
        wait_for(lambda: last.error or (table_counts(dsn, table) == expected
                                        and sorted(folder_values(tmp_path / "evens", "id")) == expected_evens),
                 timeout=300, what="v3's output of every row")
    module_store.request_stop(pid, "graceful")
    assert last.join(240).state is PipelineState.STOPPED
    assert table_counts(dsn, table) == expected
    assert sorted(folder_values(tmp_path / "evens", "id")) == expected_evens
    assert partitions() == 8  # v3 kept the rescaled state
