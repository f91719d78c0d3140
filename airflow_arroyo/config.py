"""The provider's ``[arroyo]`` section of Airflow's configuration (``airflow.cfg``, ``AIRFLOW__ARROYO__*``).

One table, :data:`OPTIONS`, is the single source of the options: ``get_provider_info()`` publishes it
(so ``airflow config list`` shows the section with its defaults) and :func:`get` reads an option with
that default as the fallback (so an option works even where provider configuration is not loaded).
Read on the Airflow side only: the runtime driver never imports Airflow and gets its settings from
its command line and environment (``--storage-uri``, ``ARROYO_DSN``), which the submit operator fills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "OPTIONS", "SECTION", "default_deferrable", "get", "get_bool", "get_float", "get_int", "openlineage_flag",
    "provider_config",
]

SECTION = "arroyo"


@dataclass(frozen=True)
class Option:
    default: str
    type: str  # "string" | "integer" | "float" | "boolean" (as Airflow's config descriptions spell them)
    description: str
    example: str | None = None


OPTIONS: dict[str, Option] = {
    "conn_id": Option(
        "arroyo_default", "string",
        "The Airflow connection of the epoch store (type ``arroyo`` or ``postgres``) that operators, sensors, "
        "the retention DAG and the UI plugin use when none is given.",
    ),
    "checkpoint_uri": Option(
        "", "string",
        "Root of the stages' Spark checkpoints (a Hadoop filesystem path Spark writes: a shared disk, "
        "hdfs://, or s3a:// with the S3A connector) handed to the driver when a SubmitPipelineOperator names "
        "none. Empty: under storage_uri. Separate it when channels and snapshots live on an object store "
        "Spark cannot write (docs/runtime.md, Object storage).",
        "hdfs:///arroyo/checkpoints",
    ),
    "spark_conn_id": Option(
        "spark_default", "string",
        "The apache-spark provider's connection (master, deploy mode) used by SubmitPipelineOperator "
        "when none is given.",
    ),
    "storage_uri": Option(
        "", "string",
        "Root of the pipelines' channels and snapshots (a local path, file://, s3://, gs://, abfs://... "
        "URI) handed to the driver when a SubmitPipelineOperator names none. Empty: none is handed over, and "
        "the driver needs ARROYO_STORAGE_URI in its environment (a pipeline has no storage of its own); the "
        "example DAG then uses $AIRFLOW_HOME/arroyo-data.",
        "s3://bucket/arroyo",
    ),
    "submit_log_dir": Option(
        "", "string",
        "Where the spark-submit log of each run goes on the worker host. Empty: $AIRFLOW_HOME/logs/arroyo.",
    ),
    "checkpoint_interval": Option(
        "30", "float", "Default checkpoint interval in seconds: the period of the epochs' fixed-rate schedule.",
    ),
    "example_pipeline_id": Option(
        "arroyo-demo", "string", "The pipeline id of the example streaming DAG (and its downstream DAG).",
    ),
    "triggerer_freeze_gc": Option(
        "True", "boolean",
        "When the first checkpoint trigger starts in a triggerer process, collect garbage once and move every "
        "object alive then (mostly the imported modules) out of the reach of Python's cyclic garbage collector "
        "(gc.freeze), whose full collections otherwise stop the triggerer's event loop long enough to make "
        "epochs start late (docs/controller.md, Load). False: leave the process's collector alone.",
    ),
    "lineage_kafka_namespace": Option(
        "", "string",
        "The OpenLineage namespace (kafka://host:port, one of the bootstrap servers) of the Kafka cluster the "
        "pipelines' Kafka sources read, in the epochs' OpenLineage events (docs/lineage.md): Spark's offset log "
        "names the topics, not the brokers. Empty: kafka://unknown.",
        "kafka://broker1:9092",
    ),
    "retention_schedule": Option(
        "*/15 * * * *", "string", "Schedule of the arroyo_retention DAG (a cron expression).",
    ),
    "retention_keep_last": Option(
        "10", "integer", "Default of the retention DAG: keep the newest N completed epochs of each pipeline.",
    ),
    "retention_keep_newer_than": Option(
        "", "string",
        "Default of the retention DAG: also keep epochs newer than this age (e.g. 2h, 30m, 1d). Empty: none.",
        "2h",
    ),
    "retention_compact_after": Option(
        "7d", "string",
        "Default of the retention DAG: after pruning, delete the rows of epochs pruned (and history and cleanup "
        "runs released) longer ago than this, e.g. 7d; 'none': keep them all. Restores never need them.",
        "30d",
    ),
    "retention_scrub_budget": Option(
        "60s", "string",
        "Default of the retention DAG: after pruning, re-hash snapshot objects for at most this long (least "
        "recently verified first, so successive runs cover them all) and report damaged epochs. Empty: no scrub.",
        "5m",
    ),
}


def _conf() -> Any:
    try:  # Airflow >= 3.1: the Task SDK's configuration (what workers and the dag-processor read)
        from airflow.sdk.configuration import conf
    except ImportError:  # pragma: no cover - older Airflow 3
        from airflow.configuration import conf
    return conf


def get(option: str) -> str:
    """``[arroyo] <option>`` from Airflow's configuration, with the provider's default."""
    spec = OPTIONS[option]
    value = _conf().get(SECTION, option, fallback=spec.default)
    return str(value) if value is not None else spec.default


def get_int(option: str) -> int:
    """An option of the ``[arroyo]`` section as an int."""
    return int(get(option))


def get_bool(option: str) -> bool:
    """An option of the ``[arroyo]`` section as a bool, read as Airflow reads booleans (``conf.getboolean``:
    a value it cannot read raises its ``AirflowConfigException``, naming the option)."""
    return bool(_conf().getboolean(SECTION, option, fallback=OPTIONS[option].default.lower() == "true"))


def get_float(option: str) -> float:
    """An option of the ``[arroyo]`` section as a float."""
    return float(get(option))


def provider_config() -> dict[str, Any]:
    """The ``config`` entry of ``get_provider_info()``."""
    return {
        SECTION: {
            "description": "airflow-arroyo: defaults of the checkpoint-epoch operators, the retention DAG "
            "and the example DAGs.",
            "options": {
                name: {
                    "description": spec.description,
                    "version_added": "0.2.0",
                    "type": spec.type,
                    "example": spec.example,
                    "default": spec.default,
                }
                for name, spec in OPTIONS.items()
            },
        }
    }


def dags_folder() -> str:
    """``[core] dags_folder``: Airflow's DAGs folder ('' when not set)."""
    value = _conf().get("core", "dags_folder", fallback="")
    return str(value or "")


def default_deferrable() -> bool:
    """``[operators] default_deferrable``: Airflow's switch for the deferrable mode of operators."""
    return bool(_conf().getboolean("operators", "default_deferrable", fallback=False))


def openlineage_flag(option: str) -> bool:
    """``[openlineage] <option>`` (e.g. ``spark_inject_parent_job_info``), False when not set."""
    return bool(_conf().getboolean("openlineage", option, fallback=False))
