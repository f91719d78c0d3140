"""Example: a batch DAG scheduled on committed streaming data (Airflow's data awareness).

The demo pipeline of ``example_streaming_pipeline`` writes its report to an exactly-once Parquet sink
(``report_files``). Each time the sink commits an epoch, the Asset of that folder gets an event
(``airflow_arroyo.assets``: an ``AssetWatcher`` in the triggerer, and the ``stop`` task's outlet at
the end) whose extra carries the commit: ``uri``, ``epoch``, ``batch_id``, ``rows``, ``bytes``. This
DAG runs on it and reads exactly what that commit made visible: the files of batches up to
``batch_id``, never a pending or half-written batch. It returns what it read (XCom) so that a reader
can compare it with the commit's figures.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from airflow.sdk import DAG, task
from airflow.sdk.exceptions import AirflowSkipException

from airflow_arroyo.examples.report import report_asset

REPORT = report_asset()

with DAG(
    dag_id="example_committed_report",
    description="Reads the demo pipeline's committed report each time the sink commits an epoch",
    schedule=[REPORT],
    start_date=datetime(2024, 1, 1),
    catchup=False,
    tags=["arroyo", "example"],
    doc_md=__doc__,
) as dag:

    @task(inlets=[REPORT])
    def read_committed_report(*, triggering_asset_events: Any = None) -> dict[str, Any]:
        """Read the rows of the newest commit among the events that triggered this run."""
        from airflow_arroyo.assets import committed_payloads
        from airflow_arroyo.examples.report import read_committed

        payloads = committed_payloads(triggering_asset_events[REPORT] if triggering_asset_events else [])
        if not payloads:
            # e.g. the event of the `stop` task of a run that never committed (its driver failed to start):
            # nothing new is visible, so there is nothing to read
            raise AirflowSkipException("no commit of the report sink among the triggering Asset events")
        commit = payloads[-1]
        read = read_committed(str(commit["uri"]), int(commit["batch_id"]))
        print(f"epoch {commit['epoch']} (batch {commit['batch_id']}): read {read['rows']} committed rows "
              f"in {read['files']} files; this commit added {commit['rows']} rows, {commit['bytes']} bytes")
        return {**read, "epoch": commit["epoch"], "batch_id": commit["batch_id"], "seq": commit.get("seq"),
                "commit_rows": commit["rows"], "events": len(payloads)}

    read_committed_report()
