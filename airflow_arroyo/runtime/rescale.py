"""Rescale a restored stage's state into another number of state partitions (issue 32, deliverable 3).

Spark pins a stateful query's partition count in its checkpoint (``spark.sql.shuffle.partitions`` in the metadata
line of ``offsets/<b>``, rebound on every restart), so changing the stage's conf does nothing to a restored query.
Spark 4.2 ships an offline repartitioning of a checkpoint (``StreamingCheckpointManager.repartition``, SPARK-54346
and its followers; reached from PySpark as ``spark._streamingCheckpointManager``): it appends a repartition batch
``b+1`` (``offsets/b+1`` with the new count, ``commits/b+1``) and rewrites every state store into the new
partitions as state version ``b+2``, reading all column families through the state data source. The query then
resumes at batch ``b+2``.

Here it runs on the folder a restore has just rebuilt from the epoch's snapshot (:meth:`SnapshotStore.rebuild`:
a new folder of this run; the epoch's objects are only read), before the restore's commit point: a failure
discards that folder and changes nothing. The partitions a shrink leaves behind (``state/<op>/<p>`` for
``p >= new``) are deleted from it, so a later snapshot does not carry them.

Spark 4.2 rescales only the RocksDB state store (``state_store="rocksdb"``); a stage on the default store is
refused before anything is written, naming that fix. Operators it supports: streaming aggregation,
``dropDuplicates`` (also within a watermark), session windows, stream-stream joins, ``flatMapGroupsWithState`` and
``transformWithState``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from airflow_arroyo.core.exceptions import ConfigurationError
from airflow_arroyo.runtime.spark_checkpoint import latest_commit, offsets_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from airflow_arroyo.core.fs import FileSystem

__all__ = ["ROCKSDB_PROVIDER", "CheckpointPartitions", "checkpoint_partitions", "rescale_checkpoint"]

log = logging.getLogger(__name__)

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
_PARTITIONS = "spark.sql.shuffle.partitions"
_PROVIDER = "spark.sql.streaming.stateStore.providerClass"


@dataclass(frozen=True)
class CheckpointPartitions:
    """What a checkpoint's last committed batch pins: its batch, state partitions and state store provider."""

    batch: int
    partitions: int | None
    provider: str | None


def checkpoint_partitions(fs: FileSystem, folder: str) -> CheckpointPartitions:
    """Read ``offsets/<b>`` of the newest committed batch of the checkpoint ``folder`` (relative to ``fs``)."""
    batch = latest_commit(fs, folder)
    if batch < 0:
        return CheckpointPartitions(batch, None, None)
    lines = fs.read_bytes(offsets_path(folder, batch)).decode().splitlines()
    meta = json.loads(lines[1]) if len(lines) > 1 and lines[1].strip().startswith("{") else {}
    conf = meta.get("conf") or {}
    partitions = conf.get(_PARTITIONS)
    return CheckpointPartitions(batch, int(partitions) if partitions is not None else None, conf.get(_PROVIDER))


def rescale_checkpoint(spark: SparkSession, fs: FileSystem, folder: str, partitions: int, *, stage: str) -> int:
    """Rewrite the checkpoint ``folder`` (this run's own copy) into ``partitions`` state partitions; returns the
    count it had. Nothing happens when it already has that many."""
    if isinstance(partitions, bool) or not isinstance(partitions, int) or partitions < 1:
        raise ConfigurationError(f"stage {stage!r}: rescale to a whole number of partitions >= 1, got {partitions!r}")
    before = checkpoint_partitions(fs, folder)
    if before.batch < 0 or before.partitions is None:
        raise ConfigurationError(f"stage {stage!r} has no committed batch in the restored epoch: it holds no state "
                                 "to rescale (set its spark.sql.shuffle.partitions instead)")
    if before.partitions == partitions:
        return partitions
    if before.provider != ROCKSDB_PROVIDER:
        raise ConfigurationError(
            f"stage {stage!r} keeps its state in {before.provider or 'the default state store'}: Spark 4.2 rescales "
            "only the RocksDB state store. Give the stage state_store='rocksdb' (from a fresh start or a stage that "
            "starts empty: a store's provider cannot change on restore), or restore without rescaling it")
    spark.streams  # noqa: B018 - creates the StateStoreCoordinator the rewrite's tasks look up
    manager = getattr(spark, "_streamingCheckpointManager", None)
    if manager is None:
        raise ConfigurationError("this Spark session has no offline state repartitioning (Spark >= 4.2, a classic "
                                 "session, not Spark Connect): rescaling needs it")
    manager.repartition(fs.spark_uri_of(folder), partitions, True)
    for op in fs.list_dir(f"{folder}/state"):
        if not op.is_dir or not op.name.isdigit():
            continue
        for part in fs.list_dir(f"{folder}/state/{op.name}"):
            if part.is_dir and part.name.isdigit() and int(part.name) >= partitions:
                fs.delete_tree(f"{folder}/state/{op.name}/{part.name}")  # left by a shrink; Spark ignores it
    after = checkpoint_partitions(fs, folder)
    if after.partitions != partitions:
        raise ConfigurationError(f"stage {stage!r}: Spark's repartitioning left {after.partitions} partitions, not "
                                 f"{partitions}; nothing was restored")
    log.info("stage %s: state rescaled from %d to %d partitions (repartition batch %d)", stage, before.partitions,
             partitions, after.batch)
    return before.partitions
