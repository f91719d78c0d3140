"""Provider metadata for Airflow's providers manager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_arroyo import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-arroyo",
        "name": "Arroyo checkpoint epochs for Spark Structured Streaming",
        "description": "Long-running PySpark Structured Streaming pipelines with Arroyo/Flink-style "
        "checkpoint epochs, controlled from Airflow.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "Arroyo epochs",
                "external-doc-url": "https://github.com/airflow-arroyo/airflow-arroyo",
                "tags": ["apache"],
            }
        ],
        "hooks": [{"integration-name": "Arroyo epochs", "python-modules": ["airflow_arroyo.hooks.arroyo"]}],
        "triggers": [
            {
                "integration-name": "Arroyo epochs",
                "python-modules": ["airflow_arroyo.triggers.checkpoint", "airflow_arroyo.triggers.pipeline"],
            }
        ],
        "operators": [
            {
                "integration-name": "Arroyo epochs",
                "python-modules": [
                    "airflow_arroyo.operators.checkpoint",
                    "airflow_arroyo.operators.pipeline",
                    "airflow_arroyo.operators.retention",
                ],
            }
        ],
        "sensors": [{"integration-name": "Arroyo epochs", "python-modules": ["airflow_arroyo.sensors.pipeline"]}],
        "extra-links": [
            "airflow_arroyo.operators.checkpoint.ArroyoCheckpointsLink",
            "airflow_arroyo.links.ArroyoPipelineLink",
            "airflow_arroyo.links.SparkUILink",
        ],
        "connection-types": [
            {"connection-type": "arroyo", "hook-class-name": "airflow_arroyo.hooks.arroyo.ArroyoHook"}
        ],
        # The UI plugin is registered once, by the package's `airflow.plugins` entry point; listing it
        # here too makes Airflow report a duplicate when providers are discovered eagerly.
    }
