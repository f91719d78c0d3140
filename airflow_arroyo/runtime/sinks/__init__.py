"""The exactly-once sinks, one module each, and which one a sink stage gets.

:mod:`~airflow_arroyo.runtime.sinks.base` is the contract (:class:`TransactionalSink`, :class:`SinkCommit`);
:mod:`~airflow_arroyo.runtime.sinks.files`, :mod:`~airflow_arroyo.runtime.sinks.postgres`,
:mod:`~airflow_arroyo.runtime.sinks.kafka` and :mod:`~airflow_arroyo.runtime.sinks.delta` implement it, and
declare their targets (``PostgresTarget``, ``KafkaTarget``, ``DeltaTarget``), which a pipeline's graph names.
The sinks import only the contract, never the graph or the driver.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from airflow_arroyo.runtime.sinks.base import SinkCommit, TransactionalSink, newest_generations
from airflow_arroyo.runtime.sinks.delta import DeltaTarget, TransactionalDeltaSink
from airflow_arroyo.runtime.sinks.files import FILE_SINK_FORMATS, TransactionalFileSink
from airflow_arroyo.runtime.sinks.kafka import KafkaTarget, TransactionalKafkaSink
from airflow_arroyo.runtime.sinks.postgres import PostgresTarget, TransactionalPostgresSink

if TYPE_CHECKING:
    from airflow_arroyo.core.fs import FileSystem
    from airflow_arroyo.runtime.graph import StageSpec

__all__ = ["FILE_SINK_FORMATS", "DeltaTarget", "KafkaTarget", "PostgresTarget", "SinkCommit", "TransactionalSink",
           "newest_generations", "transactional_sink"]


def transactional_sink(pipeline_id: str, spec: StageSpec, staging: FileSystem) -> TransactionalSink | None:
    """The exactly-once sink of a sink stage, or ``None`` for an at-least-once one. ``staging``: the folder a
    sink that stages its pre-commits in storage writes them to (the stage's own)."""
    if spec.table is not None:
        return TransactionalDeltaSink(pipeline_id, spec.name, spec.table)
    if spec.kafka is not None:
        return TransactionalKafkaSink(pipeline_id, spec.name, spec.kafka, staging)
    if spec.postgres is not None:
        return TransactionalPostgresSink(pipeline_id, spec.name, spec.postgres)
    if spec.sink_format in FILE_SINK_FORMATS:
        assert spec.sink_format is not None
        return TransactionalFileSink(pipeline_id, spec.name, spec.sink_format, spec.sink_options)
    return None
