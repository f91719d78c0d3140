"""The demo pipeline on a real Spark standalone cluster, submitted through ``SubmitPipelineOperator``.

A master and two workers (separate JVMs, 1 core each, on loopback) run the executors; the driver runs
in the ``spark-submit`` process the operator starts (standalone client mode), with a
``spark://127.0.0.1:PORT`` connection. The test plays the checkpoint controller (``trigger_tick``).

1. Submit; epochs complete; the application's executors are JVMs launched by both workers.
2. SIGKILL one worker (its executor and Python workers with it) while an epoch is in flight: Spark
   reschedules on the other worker and later epochs complete; or the pipeline fails with a cause
   naming the lost executor (both are acceptable outcomes; which one happened is printed).
3. SIGKILL the driver (the spark-submit process group), submit a second run with
   ``restore_from="latest"`` (on the worker left): it restores the latest completed epoch and runs to
   the end of the input; the report channel and the exactly-once Parquet sink hold exactly the rows computed in plain
   Python (``expected_report``), none lost, none twice. The demo runs in its default form: both sources, the join
   and the filter fused into one query (operator chaining), the report channel before the sink.
"""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import TaskDeferred

from airflow_arroyo.core.epochs import EpochState, PipelineState
from airflow_arroyo.core.processes import LocalProcess
from airflow_arroyo.devtools.spark_cluster import StandaloneCluster
from airflow_arroyo.examples import OUTPUT_CHANNEL, expected_report
from airflow_arroyo.operators.pipeline import SubmitPipelineOperator
from airflow_arroyo.runtime.channel import Channel
from airflow_arroyo.runtime.stage import StorageLayout
from airflow_arroyo.store import EpochStore
from airflow_arroyo.testing import CheckpointTicker, channel_row_count, channel_rows, committed_rows, wait_for
from tests.airflow.test_pipeline_operators import _TI, run_trigger

# two driver starts on a 2-core machine: minutes (10-13 min measured while five test runs shared it)
pytestmark = [pytest.mark.spark, pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(1800)]

PID = "on-cluster"
CONN = "arroyo_cluster_test"
SPARK = "spark_cluster_test"
ROWS = 800
PER_BATCH = 80


def submit(tmp_path: Path, run: str, **kwargs: Any) -> tuple[SubmitPipelineOperator, _TI, LocalProcess]:
    """Run the operator as Airflow would: execute (defers), the trigger until the run is running,
    execute_complete. Returns the operator, its XComs and the detached spark-submit (the driver)."""
    op = SubmitPipelineOperator(
        task_id=f"submit-{run}", pipeline="airflow_arroyo.examples.pipelines:demo", pipeline_id=PID,
        pipeline_args={"pipeline_id": PID, "rows": ROWS, "rows_per_batch": PER_BATCH,
                       "sink_path": str(tmp_path / "report_files")},
        run_id=run, storage_uri=str(tmp_path / "storage"), conn_id=CONN, spark_conn_id=SPARK,
        conf={"spark.sql.shuffle.partitions": "2", "spark.executor.cores": "1", "spark.executor.memory": "512m",
              "spark.driver.memory": "768m", "spark.ui.enabled": "false",
              "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",  # loopback only
              # an executor lost with its worker is not the application's fault: keep retrying its tasks
              "spark.task.maxFailures": "8"},
        submit_log_dir=str(tmp_path / "logs"), register_timeout=240, poll_interval=0.5, **kwargs,
    )
    ti = _TI()
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({"ti": ti})  # type: ignore[arg-type]
    proc = ti.xcom["submit_process"]
    driver = LocalProcess(int(proc["pid"]), str(proc["host"]), proc["start_ticks"])
    event = run_trigger(deferred.value.trigger)  # type: ignore[arg-type]
    assert event["status"] == "success", (event, Path(ti.xcom["submit_log"]).read_text()[-4000:])
    op.execute_complete({"ti": ti}, event, **deferred.value.kwargs)  # type: ignore[arg-type]
    return op, ti, driver


def tail(ti: _TI, lines: int = 40) -> str:
    """The driver's log (spark-submit's output), for failure messages."""
    text = Path(ti.xcom["submit_log"]).read_text(errors="replace").splitlines()
    return "\n".join(line for line in text if not line.lstrip().startswith("at "))[-lines * 200:]


def test_demo_on_a_standalone_cluster_survives_worker_and_driver_kills(
    spark_cluster: StandaloneCluster, store: EpochStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN.upper()}", store.dsn)
    monkeypatch.setenv(f"AIRFLOW_CONN_{SPARK.upper()}",
                       json.dumps({"conn_type": "spark", "host": spark_cluster.master_url}))
    layout = StorageLayout.at(str(tmp_path / "storage"), PID)
    expected = expected_report(ROWS)
    drivers: list[LocalProcess] = []
    try:
        with CheckpointTicker(store, PID, interval=1.0, timeout=60.0, tick=0.2):
            # 1. submit on the cluster; an epoch completes; executors on both workers
            _, ti, driver = submit(tmp_path, "run-1")
            drivers.append(driver)
            # a standalone application (app-*, not local-*), reported by the driver's heartbeat
            wait_for(lambda: (store.get_pipeline(PID).spark_app_id or "").startswith("app-")
                     or not driver.group_alive(), timeout=180, what="the driver to report its application id")
            assert (store.get_pipeline(PID).spark_app_id or "").startswith("app-"), tail(ti)
            wait_for(lambda: all(spark_cluster.executor_pids(i) for i in (0, 1)), timeout=120,
                     what="an executor JVM on each worker")
            wait_for(lambda: store.latest_completed_epoch(PID) is not None, timeout=180,
                     what=f"an epoch completed on the cluster\n{tail(ti)}")

            # 2. kill a worker while an epoch is in flight
            in_flight = wait_for(lambda: store.in_flight_epoch(PID), timeout=60, interval=0.02,
                                 what="an epoch in flight")
            assert in_flight is not None
            spark_cluster.kill_worker(0)
            outcome = wait_for(
                lambda: "failed" if store.get_pipeline(PID).state is PipelineState.FAILED else (
                    "went on" if (e := store.latest_completed_epoch(PID)) is not None and e.epoch > in_flight.epoch
                    else None),
                timeout=180, what=f"the pipeline to go on or fail after the worker kill\n{tail(ti)}")
            record = store.get_pipeline(PID)
            print(f"worker killed during epoch {in_flight.epoch}: the pipeline {outcome} "
                  f"(cause: {record.failure_cause!r})")
            if outcome == "failed":
                assert record.failure_cause and "executor" in record.failure_cause.lower(), record.failure_cause
            else:
                assert record.state is PipelineState.RUNNING and record.run_id == "run-1"

            # 3. SIGKILL the driver, restore the latest epoch on the cluster
            restore_point = store.latest_completed_epoch(PID)
            assert restore_point is not None
            driver.signal_group(signal.SIGKILL)
            wait_for(lambda: not driver.group_alive(), timeout=60, what="the driver to die")
            _, ti2, driver2 = submit(tmp_path, "run-2", restore_from="latest", takeover=True)  # on the worker left
            drivers.append(driver2)
            assert store.get_pipeline(PID).restored_from_epoch == restore_point.epoch
            wait_for(lambda: channel_row_count(layout.channel_uri(OUTPUT_CHANNEL)) >= len(expected), timeout=300,
                     interval=0.5, what=f"the restored run to reach the end of the input\n{tail(ti2)}")
        store.request_stop(PID, "graceful")
        wait_for(lambda: store.get_pipeline(PID).state in (PipelineState.STOPPED, PipelineState.FAILED),
                 timeout=180, what="a graceful stop")
    finally:
        for d in drivers:
            d.signal_group(signal.SIGKILL)
    final = store.get_pipeline(PID)
    assert final.state is PipelineState.STOPPED, (final.failure_cause, tail(ti2))
    latest = store.latest_completed_epoch(PID)
    assert latest is not None and latest.is_final and latest.state is EpochState.COMPLETED

    # the default form (operator chaining decided by the graph): sources, join and filter run as one query, and
    # only the report channel remains before the sink; any inner channel a plan keeps must be exact too
    assert "left~right~joined~report" in final.stages, final.stages
    kept = {c["channel"] for c in final.config["plan"]["channels"]}
    # exactly once, on the channels and in the Parquet sink
    for channel in sorted({"left", "right", "joined"} & kept):
        ids = Channel.open(layout.channel_uri(channel)).read_table().column("id").to_pylist()
        assert sorted(ids) == list(range(ROWS)), f"{channel}: {len(ids)} ids, {len(set(ids))} distinct"
    assert channel_rows(layout.channel_uri(OUTPUT_CHANNEL)) == expected
    assert Counter(committed_rows(tmp_path / "report_files")) == Counter(expected)
