"""Names of the demo pipeline's stages that the Airflow side needs too (no Spark import here: DAG files
import this when they are parsed, on hosts without the full pyspark)."""

from __future__ import annotations

__all__ = ["GATED_PIPELINE_ID", "GATED_SINK", "GATED_TABLE", "OUTPUT_CHANNEL", "SINK_STAGE"]

OUTPUT_CHANNEL = "report"
SINK_STAGE = "report_files"
# the gated example (airflow_arroyo.examples.gated; dags/example_gated_pipeline.py, dags/example_gate_check.py)
GATED_PIPELINE_ID = "arroyo-gated-demo"
GATED_SINK = "orders_pg"
GATED_TABLE = "arroyo_gated_orders"
