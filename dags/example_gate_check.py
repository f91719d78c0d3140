"""Example: a commit gate's check. Runs each time an epoch of the gated sink waits for a verdict.

``dags/example_gated_pipeline.py`` runs a pipeline whose PostgreSQL sink ``orders_pg`` is gated: each epoch's orders
wait in the sink's pending table until a verdict. This DAG is scheduled on the Asset
``gate_asset("arroyo-gated-demo", "orders_pg")`` (``airflow_arroyo.assets``: an ``AssetWatcher`` in the triggerer
announces every gate the driver opens), and ``check_orders`` runs a SQL check on exactly the epochs its triggering
events name: against the temporary view ``pending`` of those rows only, in a READ ONLY transaction, in the sink's
target database. It passes when the first row of the check is all true (like ``SQLCheckOperator``): the pipeline
then commits the epoch. Otherwise the task records ``failed`` with the row, and fails; the gate's policy (``hold``)
keeps the epoch and the later ones out of the table until a person passes it.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG

from airflow_arroyo import config
from airflow_arroyo.assets import gate_asset
from airflow_arroyo.examples.names import GATED_PIPELINE_ID, GATED_SINK
from airflow_arroyo.operators.gates import EpochGateCheckOperator

ORDERS_PENDING = gate_asset(GATED_PIPELINE_ID, GATED_SINK, poll_interval=2.0)

with DAG(
    dag_id="example_gate_check",
    description="Checks each epoch of the gated orders sink before it commits",
    schedule=[ORDERS_PENDING],
    start_date=datetime(2024, 1, 1),
    catchup=False,
    tags=["arroyo", "example", "gates"],
    doc_md=__doc__,
) as dag:
    EpochGateCheckOperator(
        task_id="check_orders",
        pipeline_id=GATED_PIPELINE_ID,
        sink=GATED_SINK,
        conn_id=config.get("conn_id"),  # the sink's target database: the example writes into the store's
        sql="SELECT count(*) = count(order_id) AS ids_present,"
            " count(DISTINCT order_id) = count(*) AS ids_unique,"
            " coalesce(min(amount), 0) >= 0 AS amounts_not_negative"
            " FROM pending",
        inlets=[ORDERS_PENDING],
    )
