"""Example: Kafka in, Kafka out, exactly once: the ``kafka_orders`` pipeline with checkpoint epochs, then stopped.

::

    submit                            (supervised: restarts the pipeline when its driver fails)
    checkpoints                       (an epoch every `interval` s; after `epochs` it stops the pipeline)
    run_for ──> stop                  (waits until it stopped or `minutes`, then makes sure it is stopped)

``submit`` starts ``airflow_arroyo.examples.pipelines:kafka_orders``: Spark's Kafka source reads orders from
``input_topic`` (JSON values; some delivered twice), the pipeline keeps the first of each id (keyed state), and
the exactly-once Kafka sink writes them to ``output_topic``, each epoch's output in one Kafka transaction: a
consumer reading ``read_committed`` sees every order once, across restarts. The tasks are those of
``example_streaming_pipeline`` (read its docs). ``scripts/dev.sh demo --kafka`` starts a Kafka broker on
loopback, fills the input topic and triggers this DAG with the broker's address.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_arroyo import config
from airflow_arroyo.examples.report import storage_uri
from airflow_arroyo.operators.checkpoint import CheckpointOperator
from airflow_arroyo.operators.pipeline import StopPipelineOperator, SubmitPipelineOperator
from airflow_arroyo.sensors.pipeline import PipelineSensor

PIPELINE_ID = "arroyo-kafka-demo"
CONN_ID = config.get("conn_id")
RUN_ID = "{{ dag.dag_id }}.{{ run_id }}"

with DAG(
    dag_id="example_kafka_pipeline",
    description="Kafka orders deduplicated into Kafka, exactly once, with checkpoint epochs",
    schedule=None,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["arroyo", "example", "kafka"],
    doc_md=__doc__,
    params={
        "bootstrap_servers": Param("127.0.0.1:9092", type="string", description="the Kafka cluster (host:port,...)"),
        "input_topic": Param("orders", type="string", description="topic the orders are read from"),
        "output_topic": Param("orders-deduplicated", type="string", description="topic written exactly once"),
        "interval": Param(5, type="number", exclusiveMinimum=0, description="seconds between checkpoints"),
        "epochs": Param(10, type="integer", minimum=1,
                        description="completed epochs of this run, the stop's final epoch included"),
        "minutes": Param(10, type="number", exclusiveMinimum=0, description="... or after this many minutes"),
        "restore_from": Param("", type="string", description="'' (fresh start), 'latest' or an epoch number"),
        "restart_strategy": Param('{"type": "fixed-delay", "attempts": 3, "delay": 2}', type="string",
                                  description="restart strategy (JSON; '' runs unsupervised)"),
    },
) as dag:
    submit = SubmitPipelineOperator(
        task_id="submit",
        pipeline="airflow_arroyo.examples.pipelines:kafka_orders",
        pipeline_id=PIPELINE_ID,
        pipeline_args={
            "pipeline_id": PIPELINE_ID,
            "bootstrap_servers": "{{ params.bootstrap_servers }}",
            "input_topic": "{{ params.input_topic }}",
            "output_topic": "{{ params.output_topic }}",
        },
        restore_from="{{ params.restore_from }}",
        run_id=RUN_ID,
        restart_strategy="{{ params.restart_strategy }}",
        storage_uri=storage_uri(),
        conn_id=CONN_ID,
        spark_conn_id=config.get("spark_conn_id"),
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
    )
    run_for >> stop  # submit and checkpoints wait for the run themselves
