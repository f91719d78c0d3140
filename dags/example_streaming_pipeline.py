"""Example: run the demo streaming pipeline with checkpoint epochs, supervised, then stop it.

::

    submit                            (supervised: restarts the pipeline when its driver fails)
    checkpoints                       (an epoch every `interval` s; after `epochs` it stops the pipeline)
    run_for ──> stop                  (waits until it stopped or `minutes`, then makes sure it is stopped)

* ``submit`` starts ``airflow_arroyo.examples.pipelines:demo`` (two generator sources, a keyed
  stream-stream join of both, a filter, and an exactly-once Parquet sink whose commits are the report
  Asset's events) as a long-running Spark application with spark-submit
  (connection ``spark_default``; local mode on one machine) as run ``<dag id>.<DAG run id>``, then
  supervises it in the triggerer for its whole life (``restart_strategy``, Flink's restart strategies):
  when the driver dies it resubmits the pipeline restoring the latest completed epoch, and the task
  ends when the pipeline stops (or fails with the last cause when the strategy gives up). So the
  other tasks do not wait for it: they wait for the run themselves (it has a known id).
* ``checkpoints`` is the checkpoint controller: it runs in the triggerer for the pipeline's whole
  life (across restarts), never two epochs in flight, never while the retention DAG holds the cleanup
  lock.
* ``checkpoints`` (``stop_after_epochs``) asks for a graceful stop once ``epochs - 1`` epochs have
  completed or are in flight, so that the stop's final epoch is the ``epochs``-th: a run of
  ``epochs=5`` has exactly 5 completed epochs when nothing fails.
* ``run_for`` waits until the pipeline stopped, or ``minutes`` (a timeout is a skip, not a
  failure); ``stop`` then makes sure it is stopped (gracefully, with a final epoch, after a
  timeout; at once when it already stopped). ``stop`` runs whatever happened upstream, so a DAG
  run never leaves a pipeline behind.

Trigger it with a conf to change the parameters, e.g. ``{"interval": 2, "epochs": 5}``;
``{"restore_from": "latest"}`` resumes from the newest completed epoch of an earlier run;
``{"restart_strategy": ""}`` runs it unsupervised.

Settings from Airflow's configuration, section ``[arroyo]`` (``airflow.cfg`` or
``AIRFLOW__ARROYO__*``; read when the DAG file is parsed): ``storage_uri`` (root of channels and
snapshots; default ``$AIRFLOW_HOME/arroyo-data``), ``example_pipeline_id`` (default ``arroyo-demo``),
``conn_id`` (default ``arroyo_default``), ``spark_conn_id`` (default ``spark_default``).

The waits (``submit``, ``run_for``, ``stop``) are deferrable here whatever
``[operators] default_deferrable`` says: they last minutes, and the triggerer holds no worker slot.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_arroyo import config
from airflow_arroyo.examples.report import pipeline_id, report_asset, report_uri, storage_uri
from airflow_arroyo.operators.checkpoint import CheckpointOperator
from airflow_arroyo.operators.pipeline import StopPipelineOperator, SubmitPipelineOperator
from airflow_arroyo.sensors.pipeline import PipelineSensor

PIPELINE_ID = pipeline_id()
CONN_ID = config.get("conn_id")
SPARK_CONN_ID = config.get("spark_conn_id")
STORAGE_URI = storage_uri()
REPORT = report_asset()  # the Parquet sink's folder: an Asset event per committed epoch
RUN_ID = "{{ dag.dag_id }}.{{ run_id }}"  # the run's lineage: its restarts are RUN_ID.restart<n>

with DAG(
    dag_id="example_streaming_pipeline",
    description="The demo streaming pipeline with checkpoint epochs, run for a while, then stopped",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["arroyo", "example"],
    doc_md=__doc__,
    params={
        "interval": Param(5, type="number", exclusiveMinimum=0, description="seconds between checkpoints"),
        "epochs": Param(10, type="integer", minimum=1,
                        description="completed epochs of this run, the stop's final epoch included"),
        "minutes": Param(10, type="number", exclusiveMinimum=0, description="... or after this many minutes"),
        "restore_from": Param("", type="string", description="'' (fresh start), 'latest' or an epoch number"),
        "rows": Param(20000, type="integer", minimum=1, description="rows each demo source generates"),
        "rows_per_batch": Param(500, type="integer", minimum=1, description="rows per source micro-batch"),
        "trigger_interval": Param(1.0, type="number", minimum=0, description="seconds between micro-batches"),
        "restart_strategy": Param('{"type": "fixed-delay", "attempts": 3, "delay": 2}', type="string",
                                  description="restart strategy (JSON; '' runs unsupervised), see "
                                              "airflow_arroyo.core.supervision"),
    },
) as dag:
    submit = SubmitPipelineOperator(
        task_id="submit",
        pipeline="airflow_arroyo.examples.pipelines:demo",
        pipeline_id=PIPELINE_ID,
        pipeline_args={
            "pipeline_id": PIPELINE_ID,
            "rows": "{{ params.rows }}",
            "rows_per_batch": "{{ params.rows_per_batch }}",
            "trigger_interval": "{{ params.trigger_interval }}",
            "sink_path": report_uri(),
        },
        restore_from="{{ params.restore_from }}",
        run_id=RUN_ID,
        restart_strategy="{{ params.restart_strategy }}",
        storage_uri=STORAGE_URI,
        conn_id=CONN_ID,
        spark_conn_id=SPARK_CONN_ID,
        conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.driver.memory": "1g",
            "spark.ui.showConsoleProgress": "false",
        },
        deferrable=True,
    )
    checkpoints = CheckpointOperator(
        task_id="checkpoints",
        pipeline_id=PIPELINE_ID,
        conn_id=CONN_ID,
        interval="{{ params.interval }}",
        poll_interval="{{ [params.interval / 4, 5] | min }}",
        pipeline_run_id=RUN_ID,
        stop_after_epochs="{{ params.epochs }}",
    )
    run_for = PipelineSensor(
        task_id="run_for",
        pipeline_id=PIPELINE_ID,
        conn_id=CONN_ID,
        run_id=RUN_ID,
        state="stopped",
        wait_timeout="{{ params.minutes * 60 }}",
        trigger_poll_interval=2.0,
        soft_fail=True,
        deferrable=True,
    )
    stop = StopPipelineOperator(
        task_id="stop",
        pipeline_id=PIPELINE_ID,
        conn_id=CONN_ID,
        mode="graceful",
        trigger_rule="all_done",
        deferrable=True,
        outlets=[REPORT],  # the final commit, once stopped
    )
    run_for >> stop  # submit and checkpoints wait for the run themselves
