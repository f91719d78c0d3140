"""Retention DAG: prune old checkpoint epochs of every registered pipeline.

One run lists the pipelines registered in the epoch store, then runs one mapped
``PruneEpochsOperator`` task per pipeline. Each task holds that pipeline's cleanup lock while it
works (the checkpoint trigger waits meanwhile), so pipelines are pruned independently.

Configuration (Airflow Variables, or the ``[arroyo]`` section of Airflow's configuration,
``airflow.cfg`` / ``AIRFLOW__ARROYO__*``, when a Variable is not set):

* ``arroyo_retention_schedule`` / ``retention_schedule``: cron or preset (default every 15 min;
  read when the DAG is parsed);
* ``arroyo_retention_keep_last`` / ``retention_keep_last``: completed epochs to keep (default 10);
* ``arroyo_retention_keep_newer_than`` / ``retention_keep_newer_than``: also keep epochs newer
  than this, e.g. ``6h`` (default: not set);
* ``arroyo_retention_compact_after`` / ``retention_compact_after``: then delete the rows of epochs pruned
  (and history and cleanup runs released) longer ago than this (default ``7d``; ``none``: keep them), so
  the store stays bounded (docs/retention.md, "Compaction");
* ``arroyo_retention_scrub_budget`` / ``retention_scrub_budget``: after pruning, re-hash snapshot objects
  for at most this long and report damaged epochs (default ``60s``; empty: no scrub);
* ``arroyo_retention_conn_id`` / ``conn_id``: the epoch store connection (default ``arroyo_default``).

The policy values are rendered when a task runs, so a changed Variable applies to the next run.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import DAG, Variable, task

from airflow_arroyo import config
from airflow_arroyo.operators.retention import PruneEpochsOperator

SCHEDULE = Variable.get("arroyo_retention_schedule",
                        default=config.get("retention_schedule"))

with DAG(
    dag_id="arroyo_retention",
    description="Prune old checkpoint epochs of every registered Arroyo pipeline",
    schedule=SCHEDULE,
    start_date=datetime(2024, 1, 1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 1, "retry_delay": timedelta(minutes=1)},
    # defaults of the Variables below; a manual run may override them in its conf
    params={
        "conn_id": config.get("conn_id"),
        "keep_last": config.get("retention_keep_last"),
        "keep_newer_than": config.get("retention_keep_newer_than"),
        "scrub_budget": config.get("retention_scrub_budget"),
        "compact_after": config.get("retention_compact_after"),
    },
    tags=["arroyo", "retention"],
    doc_md=__doc__,
) as dag:
    conn_id = "{{ var.value.get('arroyo_retention_conn_id', params.conn_id) }}"

    @task
    def registered_pipelines(conn_id: str) -> list[str]:
        """Every pipeline registered in the epoch store (running or not: stopped ones keep epochs too)."""
        from airflow_arroyo.hooks.arroyo import ArroyoHook

        return [p.pipeline_id for p in ArroyoHook(conn_id).get_store().list_pipelines()]

    PruneEpochsOperator.partial(
        task_id="prune_epochs",
        conn_id=conn_id,
        keep_last="{{ var.value.get('arroyo_retention_keep_last', params.keep_last) }}",
        keep_newer_than="{{ var.value.get('arroyo_retention_keep_newer_than', params.keep_newer_than) }}",
        scrub_budget="{{ var.value.get('arroyo_retention_scrub_budget', params.scrub_budget) }}",
        compact_after="{{ var.value.get('arroyo_retention_compact_after', params.compact_after) }}",
        map_index_template="{{ task.pipeline_id }}",
    ).expand(pipeline_id=registered_pipelines(conn_id))
