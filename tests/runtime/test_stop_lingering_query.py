"""A stop never reports a run stopped while one of its queries still runs. Spark's ``StreamingQuery.stop()`` waits
``spark.sql.streaming.stopTimeout`` for the stream thread, then raises and leaves the thread running: a micro-batch
blocked in Python cannot be interrupted, and once it returns the thread goes on to its next batch and writes the
checkpoint (``offsets/N``) after the driver said ``stopped``, where a successor may already restore."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from airflow_arroyo.core.epochs import PipelineState
from airflow_arroyo.core.exceptions import PipelineFailedError
from airflow_arroyo.runtime.driver import PipelineDriver
from airflow_arroyo.runtime.pipeline import Pipeline
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import DriverThread, generator_source, wait_for

pytestmark = [pytest.mark.spark]


def test_a_query_still_running_after_sparks_stop_gave_up_fails_the_run_instead_of_stopping_it(
        spark: Any, module_store: EpochStore, tmp_path: Path) -> None:
    pid = f"lingering-{uuid.uuid4().hex[:6]}"
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def stuck(df: Any, batch_id: int) -> None:  # foreachBatch runs in this process: a batch that will not end
        if armed.is_set():
            entered.set()
            release.wait(300)

    p = Pipeline(pid, chaining=False)
    src = p.source("src", lambda s: generator_source(s, rows_per_second=20, partitions=1))
    p.sink("out", [src], foreach_batch=stuck)
    driver = PipelineDriver(p, module_store, storage_uri=str(tmp_path / "storage"), spark=spark)
    driver.query_stop_grace = 1.0
    thread = DriverThread(driver).start()
    timeout = spark.conf.get("spark.sql.streaming.stopTimeout")
    try:
        wait_for(lambda: thread.error or driver.started.is_set(), timeout=240, what="the queries started")
        wait_for(lambda: thread.error or module_store.get_pipeline(pid).state is PipelineState.RUNNING,
                 timeout=240, what="the pipeline running")
        armed.set()
        wait_for(lambda: thread.error or entered.is_set(), timeout=60, what="a micro-batch of 'out' blocked")
        spark.conf.set("spark.sql.streaming.stopTimeout", "1s")  # read by Spark's stop()
        driver.request_stop("immediate")
        with pytest.raises(PipelineFailedError, match=(
                r"stage 'out': its query's stream thread still ran 1s after Spark's stop gave up "
                r"\(java.util.concurrent.TimeoutException: Stream Execution thread .* failed to stop")):
            thread.join(120)
        record = module_store.get_pipeline(pid)
        assert record.state is PipelineState.FAILED and "still ran" in (record.failure_cause or "")
        src, out = (_stream_thread(r.query) for r in driver.runners)
        assert not src.isAlive()  # the source's query stopped as asked
        assert out.isAlive()  # what the failure says: 'out' still runs (isActive already says False)
    finally:
        release.set()
        spark.conf.set("spark.sql.streaming.stopTimeout", timeout)
    wait_for(lambda: not out.isAlive(), timeout=60, what="the released query's stream thread to end")


def _stream_thread(query: Any) -> Any:
    assert query is not None
    return query._jsq.streamingQuery().queryExecutionThread()
