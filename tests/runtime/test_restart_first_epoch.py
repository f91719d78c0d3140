"""The first epoch after a restore completes within two intervals of the run going ``running`` (issue 30, finding 3),
on real Spark with a real epoch store.

A restored stage's checkpoint already holds committed batches, but its query has run none in this process: its
first micro-batch still pays for its state store, Python workers and code generation (measured on the demo under a
loaded machine: 20-37 s, against 2-6 s for later batches). The driver's warm-up took the checkpoint's batches for
the query's own and let the run go ``running`` at once; the first epoch then started during that batch, and its
barrier waited for the batch to end (the reported 19-39 s first epochs). Here the first micro-batch of each run is
made slow on purpose (the sink's writer takes ``SLOW_FIRST_BATCH`` seconds for it), so the test does not depend on
how slow Spark happens to be."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.runtime import Pipeline
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, DriverThread, generator_source, wait_for

pytestmark = [pytest.mark.spark]

INTERVAL = 2.0
SLOW_FIRST_BATCH = 4 * INTERVAL


def pipeline(pipeline_id: str, first_batch_seconds: float) -> Pipeline:
    """A paced generator into a sink whose first micro-batch in this run takes ``first_batch_seconds`` (as a
    restored stage's first batch is slow); later batches are quick."""
    first = threading.Event()

    def read(spark: Any) -> Any:
        return generator_source(spark, seed=3, keys=10, total_rows=None, rows_per_batch=50, rows_per_second=100)

    def write(df: Any, batch_id: int) -> None:
        if not first.is_set():
            first.set()
            time.sleep(first_batch_seconds)  # the slow first batch this test is about, not a wait for anything
        df.write.format("noop").mode("overwrite").save()

    p = Pipeline(pipeline_id, description="a sink whose first micro-batch in a run is slow")
    p.sink("out", inputs=[p.source("numbers", read)], foreach_batch=write)
    return p


def completed(store: EpochStore, pipeline_id: str, run_id: str) -> list[Any]:
    return sorted((e for e in store.list_epochs(pipeline_id, limit=100)
                   if e.run_id == run_id and e.state is EpochState.COMPLETED), key=lambda e: e.epoch)


def run_epochs(spark: Any, store: EpochStore, pipeline_id: str, storage: Path, run_id: str, *, epochs: int,
               first_batch_seconds: float, restore_from: Any = None) -> tuple[Any, list[Any]]:
    """Run ``epochs`` completed epochs (a controller ticking every ``INTERVAL``), then stop at once; returns the
    pipeline's record as read once the first of them completed (its ``updated_at``: when it went ``running``) and
    the run's completed epochs."""
    driver = PipelineDriver(pipeline(pipeline_id, first_batch_seconds), store, storage_uri=str(storage),
                            run_id=run_id, restore_from=restore_from, spark=spark)
    thread = DriverThread(driver).start()
    wait_for(lambda: thread.error or driver.started.is_set(), timeout=180, what=f"run {run_id}'s queries to start")
    with CheckpointTicker(store, pipeline_id, interval=INTERVAL, timeout=120):
        wait_for(lambda: thread.error or completed(store, pipeline_id, run_id), timeout=180,
                 what=f"run {run_id}'s first completed epoch", interval=0.1)
        record = store.get_pipeline(pipeline_id)
        wait_for(lambda: thread.error or len(completed(store, pipeline_id, run_id)) >= epochs, timeout=120,
                 what=f"{epochs} completed epochs of run {run_id}", interval=0.1)
    driver.request_stop("immediate")
    thread.join(120)
    return record, completed(store, pipeline_id, run_id)


def test_the_first_epoch_after_a_restore_completes_within_two_intervals_of_running(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    store = module_store
    pid = f"first-epoch-{uuid.uuid4().hex[:8]}"
    _, before = run_epochs(spark, store, pid, tmp_path, "first", epochs=1, first_batch_seconds=0)
    record, epochs = run_epochs(spark, store, pid, tmp_path, "restored", epochs=1,
                                first_batch_seconds=SLOW_FIRST_BATCH, restore_from="latest")
    assert record.run_id == "restored" and record.state is PipelineState.RUNNING
    assert record.restored_from_epoch == before[-1].epoch
    assert record.updated_at is not None  # set when the run went running; nothing else writes it meanwhile
    first = epochs[0]
    assert first.ended_at is not None
    since_running = (first.ended_at - record.updated_at).total_seconds()
    assert since_running <= 2 * INTERVAL, (
        f"epoch {first.epoch}, the first after the restore of epoch {before[-1].epoch}, completed {since_running:.1f}s "
        f"after the run went running (interval {INTERVAL:g}s): it waited for the query's first micro-batch")
