"""Example pipelines: used by the tests, the benchmark and the example DAG."""

from airflow_arroyo.examples.pipelines import (
    OUTPUT_CHANNEL,
    SINK_STAGE,
    STATEFUL_OUTPUTS,
    demo,
    expected_report,
    expected_stateful,
    stateful_ops,
)

__all__ = [
    "OUTPUT_CHANNEL", "SINK_STAGE", "STATEFUL_OUTPUTS", "demo", "expected_report", "expected_stateful", "stateful_ops",
]
