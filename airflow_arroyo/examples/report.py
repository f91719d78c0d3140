"""The example DAGs' shared pieces on the Airflow side: where the demo pipeline's Parquet sink writes,
and its Asset (``dags/example_streaming_pipeline.py`` produces it, ``dags/example_committed_report.py``
is scheduled on it). Imports Airflow: not for the Spark driver."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow_arroyo import config
from airflow_arroyo.examples.names import SINK_STAGE

if TYPE_CHECKING:
    from airflow.sdk import Asset

__all__ = ["pipeline_id", "read_committed", "report_asset", "report_uri", "storage_uri"]


def pipeline_id() -> str:
    """The demo pipeline's id (``[arroyo] example_pipeline_id``)."""
    return config.get("example_pipeline_id")


def storage_uri() -> str:
    """``[arroyo] storage_uri``, else ``$AIRFLOW_HOME/arroyo-data``."""
    return config.get("storage_uri") or str(Path(os.environ.get("AIRFLOW_HOME") or Path.home() / "airflow")
                                            / "arroyo-data")


def report_uri() -> str:
    """The folder of the demo pipeline's exactly-once Parquet sink (``report_files``)."""
    return f"{storage_uri().rstrip('/')}/sinks/{pipeline_id()}/{SINK_STAGE}"


def report_asset() -> Asset:
    """The Asset of the demo's Parquet sink (its commits are this asset's events)."""
    from airflow_arroyo.assets import sink_asset

    return sink_asset(pipeline_id(), SINK_STAGE, report_uri(), poll_interval=2.0)


def read_committed(uri: str, batch_id: int) -> dict[str, Any]:
    """Read the sink's rows a commit through ``batch_id`` made visible (never pending or later files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from airflow_arroyo.assets import committed_files
    from airflow_arroyo.core.fs import FileSystem

    fs = FileSystem.from_uri(uri)
    files = committed_files(uri, batch_id)
    tables = [pq.read_table(pa.BufferReader(fs.read_bytes(f))) for f in files]
    ids = [i for t in tables for i in t.column("id").to_pylist()]
    return {"files": len(files), "rows": len(ids), "distinct_ids": len(set(ids)),
            "total": int(sum(v for t in tables for v in t.column("total").to_pylist()))}
