"""Exactly-once sinks: what the driver and a sink stage need of a two-phase-commit sink, and which one
a sink stage gets.

A sink stage *pre-commits* each micro-batch (:meth:`TransactionalSink.write_batch`); the driver
*commits* every batch up to the sink's cut when an epoch completes, *rolls back* to a restored epoch's
cut, and *trims* what no restore can need. Four kinds exist: files
(:mod:`~airflow_arroyo.runtime.file_sink`), PostgreSQL tables (:mod:`~airflow_arroyo.runtime.pg_sink`),
Kafka topics (:mod:`~airflow_arroyo.runtime.kafka_sink`) and Delta Lake tables
(:mod:`~airflow_arroyo.runtime.delta_sink`).
Other Spark sinks (``foreach_batch``, non-file formats) are at-least-once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from airflow_arroyo.fs import FileSystem
    from airflow_arroyo.runtime.pipeline import StageSpec
    from airflow_arroyo.store.records import FencingToken

__all__ = ["SinkCommit", "TransactionalSink", "newest_generations", "transactional_sink"]


@dataclass(frozen=True)
class SinkCommit:
    """What one commit made visible: files (0 for a table), bytes (0 when not known), rows (None when a
    batch's count is unknown), the micro-batches it covered, and the table version it made (a lakehouse
    table's commit; None for other sinks)."""

    files: int
    bytes: int
    rows: int | None
    batches: tuple[int, ...]
    version: int | None = None


class TransactionalSink(Protocol):
    """A sink that commits with epochs (batch ids are the sink stage's micro-batch ids).

    Fencing: the driver sets ``token`` (its run's fencing token) before the sink's first write; from the
    moment a newer run claimed or rolled back the sink, every pre-commit, commit and rollback of the older
    run is refused with :class:`~airflow_arroyo.exceptions.FencedError` (the PostgreSQL sink in SQL, on
    its progress row; the file sink by per-generation names and commit points).
    """

    token: FencingToken | None

    @property
    def uri(self) -> str:
        """Where it writes (no credentials)."""

    def check_writable(self) -> None:
        """Read-only: refuse (``ConfigurationError``) a target this sink may not write."""

    def claim(self) -> None:
        """Record this sink as the target's one writer; prepare what it needs."""

    def has_state(self) -> bool:
        """Has an earlier run of this sink written anything?"""

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit a micro-batch (replacing an earlier attempt of it)."""

    def commit_through(self, batch_id: int) -> SinkCommit:
        """Make every pre-committed batch ``<= batch_id`` visible (idempotent); says what it made visible."""

    def rollback_to(self, batch_id: int) -> None:
        """Keep exactly the batches ``<= batch_id``, all committed (``-1``: nothing)."""

    def trim_through(self, batch_id: int) -> None:
        """Forget what is kept only to roll back batches ``<= batch_id``."""

    def public_after(self, batch_id: int) -> int | None:
        """Read-only, before a restore's commit point: the newest batch after ``batch_id`` whose output readers
        have seen and a rollback cannot take back (None: a rollback to ``batch_id`` is possible)."""


def transactional_sink(pipeline_id: str, spec: StageSpec, staging: FileSystem) -> TransactionalSink | None:
    """The exactly-once sink of a sink stage, or ``None`` for an at-least-once one. ``staging``: the folder a
    sink that stages its pre-commits in storage writes them to (the stage's own)."""
    from airflow_arroyo.runtime.delta_sink import TransactionalDeltaSink
    from airflow_arroyo.runtime.file_sink import FILE_SINK_FORMATS, TransactionalFileSink
    from airflow_arroyo.runtime.kafka_sink import TransactionalKafkaSink
    from airflow_arroyo.runtime.pg_sink import TransactionalPostgresSink

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


def newest_generations(staged: Mapping[int, Iterable[int]], mine: int) -> dict[int, int]:
    """Per staged batch, the generation whose pre-commit counts: the highest not above this run's ``mine`` (a newer
    run's re-run of a batch wins over an older run's; a still newer run's is not this run's to commit). 0: no
    fencing token, every generation counts."""
    out: dict[int, int] = {}
    for batch, generations in staged.items():
        eligible = [g for g in generations if g <= mine or not mine]
        if eligible:
            out[batch] = max(eligible)
    return out

