"""Names of the demo pipeline's stages that the Airflow side needs too (no Spark import here: DAG files
import this when they are parsed, on hosts without the full pyspark)."""

from __future__ import annotations

__all__ = ["OUTPUT_CHANNEL", "SINK_STAGE"]

OUTPUT_CHANNEL = "report"
SINK_STAGE = "report_files"
