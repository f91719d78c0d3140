"""Example pipelines: used by the tests, the benchmark and the example DAG.

The pipelines (``pipelines``) need pyspark; they are imported on first use, so that the example DAGs,
which import ``airflow_arroyo.examples.report``, parse on hosts without the full pyspark.
"""

from __future__ import annotations

import importlib
from typing import Any

from airflow_arroyo.examples.names import OUTPUT_CHANNEL, SINK_STAGE

__all__ = [
    "OUTPUT_CHANNEL", "PG_REPORT_DDL", "PG_REPORT_STAGE", "PG_TOTALS_DDL", "PG_TOTALS_STAGE", "SINK_STAGE",
    "STATEFUL_OUTPUTS", "demo", "expected_report", "expected_stateful", "expected_totals", "kafka_order",
    "kafka_orders", "stateful_ops", "totals_of",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("airflow_arroyo.examples.pipelines"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
