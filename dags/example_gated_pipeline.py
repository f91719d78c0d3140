"""Example: a gated PostgreSQL sink. Each epoch's orders wait for a verdict before they reach the table.

::

    create_table ──> submit           (the target table, then the pipeline, supervised)
    checkpoints                       (an epoch every `interval` s; after `epochs` it stops the pipeline)
    run_for ──> stop                  (waits until it stopped or `minutes`, then makes sure it is stopped)

``submit`` starts ``airflow_arroyo.examples.gated:gated_orders``: generated orders into the table
``arroyo_gated_orders`` through the exactly-once PostgreSQL sink ``orders_pg``, declared with
``gate=Gate(policy="hold", timeout=600)``. When an epoch completes, the driver does not commit its orders: it opens
a gate, and the Asset ``gate_asset("arroyo-gated-demo", "orders_pg")`` gets the event "epoch N pending for sink
orders_pg". ``dags/example_gate_check.py`` is scheduled on it and checks that epoch's pending rows; a pass commits
them (readers of the table see them only now), a failure holds this epoch and every later one until a person
passes it (the UI's gate page, ``airflow-arroyo gate pass``) or, after more than ten epochs waiting, stops the
pipeline with the cause. A gate nobody decides within ``timeout`` times out, which ``hold`` treats as a failure.

The sink writes into the epoch store's database (``ARROYO_DSN``, which the submit operator hands the driver), so the
example needs no other database; the check reads it through the same Airflow connection (``[arroyo] conn_id``).
The other tasks are those of ``example_streaming_pipeline`` (read its docs).
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param, task

from airflow_arroyo import config
from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_TABLE
from airflow_arroyo.examples.report import storage_uri
from airflow_arroyo.operators.checkpoint import CheckpointOperator
from airflow_arroyo.operators.pipeline import StopPipelineOperator, SubmitPipelineOperator
from airflow_arroyo.sensors.pipeline import PipelineSensor

CONN_ID = config.get("conn_id")
RUN_ID = "{{ dag.dag_id }}.{{ run_id }}"

with DAG(
    dag_id="example_gated_pipeline",
    description="Orders into PostgreSQL through a commit gate: each epoch commits once its check passed",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["arroyo", "example", "gates"],
    doc_md=__doc__,
    params={
        "interval": Param(5, type="number", exclusiveMinimum=0, description="seconds between checkpoints"),
        "epochs": Param(10, type="integer", minimum=1,
                        description="completed epochs of this run, the stop's final epoch included"),
        "minutes": Param(10, type="number", exclusiveMinimum=0, description="... or after this many minutes"),
        "restore_from": Param("", type="string", description="'' (fresh start), 'latest' or an epoch number"),
        "rows": Param(5000, type="integer", minimum=1, description="orders the generator makes"),
        "rows_per_batch": Param(500, type="integer", minimum=1, description="orders per micro-batch"),
    },
) as dag:

    @task
    def create_table() -> None:
        """The sink's target table (sinks never create tables), in the epoch store's database."""
        import psycopg2

        from airflow_arroyo.examples.gated import ORDERS_DDL
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        conn = psycopg2.connect(ArroyoHook(CONN_ID).get_dsn())
        try:
            with conn, conn.cursor() as cur:
                cur.execute(ORDERS_DDL.format(table=GATED_TABLE))
        finally:
            conn.close()

    submit = SubmitPipelineOperator(
        task_id="submit",
        pipeline="airflow_arroyo.examples.gated:gated_orders",
        pipeline_id=GATED_PIPELINE_ID,
        pipeline_args={
            "pipeline_id": GATED_PIPELINE_ID,
            "rows": "{{ params.rows }}",
            "rows_per_batch": "{{ params.rows_per_batch }}",
        },
        restore_from="{{ params.restore_from }}",
        run_id=RUN_ID,
        restart_strategy='{"type": "fixed-delay", "attempts": 3, "delay": 2}',
        storage_uri=storage_uri(),
        conn_id=CONN_ID,
        spark_conn_id=config.get("spark_conn_id"),
        conf={"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2", "spark.driver.memory": "1g"},
        deferrable=True,
    )
    checkpoints = CheckpointOperator(
        task_id="checkpoints",
        pipeline_id=GATED_PIPELINE_ID,
        conn_id=CONN_ID,
        interval="{{ params.interval }}",
        pipeline_run_id=RUN_ID,
        stop_after_epochs="{{ params.epochs }}",
    )
    run_for = PipelineSensor(
        task_id="run_for",
        pipeline_id=GATED_PIPELINE_ID,
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
        pipeline_id=GATED_PIPELINE_ID,
        conn_id=CONN_ID,
        mode="graceful",
        trigger_rule="all_done",
        deferrable=True,
    )
    create_table() >> submit
    run_for >> stop  # submit and checkpoints wait for the run themselves
