"""Example pipelines: used by the tests, the benchmark and the example DAG."""

from airflow_arroyo.examples.pipelines import (
    OUTPUT_CHANNEL,
    PG_REPORT_DDL,
    PG_REPORT_STAGE,
    PG_TOTALS_DDL,
    PG_TOTALS_STAGE,
    SINK_STAGE,
    STATEFUL_OUTPUTS,
    demo,
    expected_report,
    expected_stateful,
    expected_totals,
    stateful_ops,
)

__all__ = [
    "OUTPUT_CHANNEL", "PG_REPORT_DDL", "PG_REPORT_STAGE", "PG_TOTALS_DDL", "PG_TOTALS_STAGE", "SINK_STAGE",
    "STATEFUL_OUTPUTS", "demo", "expected_report", "expected_stateful", "expected_totals", "stateful_ops",
]
