"""The PySpark side of airflow-arroyo: the pipeline API, channels, sources, stages, snapshots, sinks and the driver.

Names are re-exported lazily so that ``import airflow_arroyo.runtime`` stays cheap; each entry of
``_EXPORTS`` maps a public name to the module defining it. Append new names, do not reorder.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    # channels (airflow_arroyo.runtime.channel)
    "Channel": "airflow_arroyo.runtime.channel",
    "ChannelError": "airflow_arroyo.runtime.channel",
    "ChannelSchemaError": "airflow_arroyo.runtime.channel",
    "ChannelTruncatedError": "airflow_arroyo.runtime.channel",
    "Entry": "airflow_arroyo.runtime.channel",
    "EntryKind": "airflow_arroyo.runtime.channel",
    # Spark sources (airflow_arroyo.runtime.sources; the generator moved to airflow_arroyo.testing in 0.2 and
    # is still exported here because 0.1 documented ``from airflow_arroyo.runtime import generator_source``)
    "ChannelDataSource": "airflow_arroyo.runtime.sources",
    "read_channel": "airflow_arroyo.runtime.sources",
    "register_data_sources": "airflow_arroyo.runtime.sources",
    "write_caps": "airflow_arroyo.runtime.sources",
    "GeneratorDataSource": "airflow_arroyo.testing",
    "generate_rows": "airflow_arroyo.testing",
    "generator_source": "airflow_arroyo.testing",
    # pipeline runtime (airflow_arroyo.runtime.pipeline, .driver, .stage, .snapshot, .alignment)
    "Pipeline": "airflow_arroyo.runtime.pipeline",
    "PipelineGraph": "airflow_arroyo.runtime.graph",
    "StageKind": "airflow_arroyo.runtime.graph",
    "Stream": "airflow_arroyo.runtime.graph",
    "PipelineDriver": "airflow_arroyo.runtime.driver",
    "DriverResult": "airflow_arroyo.runtime.driver",
    "StageRunner": "airflow_arroyo.runtime.stage",
    "StorageLayout": "airflow_arroyo.runtime.layout",
    "SnapshotStore": "airflow_arroyo.runtime.snapshot",
    "AlignmentError": "airflow_arroyo.runtime.alignment",
    # exactly-once sinks' targets (airflow_arroyo.runtime.sinks)
    "PostgresTarget": "airflow_arroyo.runtime.sinks",
    "KafkaTarget": "airflow_arroyo.runtime.sinks",
    "DeltaTarget": "airflow_arroyo.runtime.sinks",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
