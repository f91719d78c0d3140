"""Example pipelines: used by the tests, the benchmark and the example DAG."""

from airflow_arroyo.examples.pipelines import OUTPUT_CHANNEL, demo, expected_report

__all__ = ["OUTPUT_CHANNEL", "demo", "expected_report"]
