"""Provider metadata for Airflow's providers manager (entry point ``apache_airflow_provider``)."""

from __future__ import annotations

from typing import Any

from airflow_arroyo import __version__
from airflow_arroyo.config import provider_config

# The connection form (Airflow >= 3.2 reads it from here, without importing the hook). The extra
# fields are libpq connection parameters; the hook passes them on to the server.
_CONN_FIELDS: dict[str, Any] = {
    "sslmode": {
        "label": "SSL mode",
        "description": "libpq sslmode: how the epoch store's server is verified",
        "schema": {"type": ["string", "null"],
                   "enum": [None, "disable", "allow", "prefer", "require", "verify-ca", "verify-full"]},
    },
    "sslrootcert": {
        "label": "SSL root certificate",
        "description": "path of the CA certificate file on the Airflow hosts (verify-ca, verify-full)",
        "schema": {"type": ["string", "null"]},
    },
    "connect_timeout": {
        "label": "Connect timeout (s)",
        "schema": {"type": ["integer", "null"], "minimum": 1},
    },
    "application_name": {
        "label": "Application name",
        "description": "shown in pg_stat_activity",
        "schema": {"type": ["string", "null"]},
    },
}


def get_provider_info() -> dict[str, Any]:
    """The provider metadata Airflow reads through the ``apache_airflow_provider`` entry point."""
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
                "python-modules": ["airflow_arroyo.triggers.checkpoint", "airflow_arroyo.triggers.gates",
                                   "airflow_arroyo.triggers.pipeline"],
            }
        ],
        "operators": [
            {
                "integration-name": "Arroyo epochs",
                "python-modules": [
                    "airflow_arroyo.operators.checkpoint",
                    "airflow_arroyo.operators.gates",
                    "airflow_arroyo.operators.pipeline",
                    "airflow_arroyo.operators.retention",
                    "airflow_arroyo.operators.upgrade",
                ],
            }
        ],
        "sensors": [{"integration-name": "Arroyo epochs",
                     "python-modules": ["airflow_arroyo.sensors.gates", "airflow_arroyo.sensors.pipeline"]}],
        "extra-links": [
            "airflow_arroyo.operators.checkpoint.ArroyoCheckpointsLink",
            "airflow_arroyo.links.pipeline.ArroyoPipelineLink",
            "airflow_arroyo.links.pipeline.SparkUILink",
        ],
        "connection-types": [
            {
                "connection-type": "arroyo",
                "hook-class-name": "airflow_arroyo.hooks.arroyo.ArroyoHook",
                "hook-name": "Arroyo epoch store",
                "conn-fields": _CONN_FIELDS,
                "ui-field-behaviour": {
                    "hidden-fields": [],
                    "relabeling": {"schema": "Database"},
                    "placeholders": {
                        "host": "postgres.example.com",
                        "port": "5432",
                        "schema": "arroyo",
                        "login": "arroyo",
                        "extra": '{"sslmode": "require"}',
                    },
                },
            }
        ],
        "config": provider_config(),
        # The UI plugin is registered once, by the package's `airflow.plugins` entry point; listing it
        # here too makes Airflow report a duplicate when providers are discovered eagerly.
    }
