"""Reading a pipeline's state as of an epoch: Spark's state data source over the epoch's snapshot.

An epoch's snapshot of a stage is a Spark checkpoint as of the stage's cut batch *b*
(:mod:`~airflow_arroyo.runtime.snapshot`). :func:`read_state` rebuilds that checkpoint from the epoch's objects
into a scratch folder of its own (the restore's rebuild, :meth:`SnapshotStore.rebuild`: every object's size and
hash verified, the objects only read, the running pipeline's checkpoint never touched), reads it with Spark's
state data source (``spark.read.format("statestore")`` with ``path``, ``batchId`` *b*, ``operatorId`` and
``storeName``; ``state-metadata`` lists a checkpoint's operators), materialises the rows in the Spark session
(``localCheckpoint``) and deletes the scratch folder before it returns. The rows are Spark's: ``key`` and
``value`` structs and ``partition_id``.

:func:`diff_state` compares two epochs' state of one stage by key: added, removed and changed keys.

What can be read is checked before Spark starts (:func:`resolve_state`), each refusal naming the problem and
the fix: an unknown pipeline, epoch or stage; an epoch that did not complete or was pruned; a stage whose
query holds no state (the stateful stages are listed); a cut at batch -1 (the stage had not run a batch: no
state yet). Airflow-free: the CLI (``airflow-arroyo state``) and notebooks call it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, NotFoundError, SnapshotError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.spark_checkpoint import state_bytes, state_operators

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from airflow_arroyo.store import EpochStore

__all__ = ["StateCut", "diff_counts", "diff_state", "local_spark", "read_state", "read_state_diff", "resolve_state",
           "state_metadata"]

#: The folder name of the rebuilt checkpoint inside a read's scratch folder.
_CHECKPOINT = "checkpoint"
#: The values :func:`diff_state` gives its ``change`` column.
ADDED, REMOVED, CHANGED = "added", "removed", "changed"


@dataclass(frozen=True)
class StateCut:
    """What an epoch's snapshot of a stage holds, read from the store (no Spark): where its objects are, the cut
    batch the state is as of, its stateful operator ids and the bytes of its state files."""

    pipeline_id: str
    epoch: int
    stage: str
    batch_id: int
    storage_uri: str
    operators: tuple[int, ...]
    state_bytes: int


@contextlib.contextmanager
def _opened(store_or_dsn: EpochStore | str) -> Iterator[EpochStore]:
    if not isinstance(store_or_dsn, str):
        yield store_or_dsn
        return
    from airflow_arroyo.store import EpochStore

    store = EpochStore(store_or_dsn, max_connections=2, application_name="airflow-arroyo-state")
    try:
        yield store
    finally:
        store.close()


def resolve_state(store: EpochStore, pipeline_id: str, epoch: int, stage: str, *,
                  storage_uri: str | None = None) -> StateCut:
    """Check that ``stage``'s state as of ``epoch`` can be read and say where it is; raises
    :class:`~airflow_arroyo.core.exceptions.NotFoundError` (unknown pipeline, epoch or stage) or
    :class:`~airflow_arroyo.core.exceptions.ConfigurationError` (not completed, pruned, no state, no state yet), each
    naming the fix. ``storage_uri``: where the snapshot objects are when not the pipeline's registered storage."""
    pipe = store.get_pipeline(pipeline_id)
    record = store.get_epoch(pipeline_id, epoch)
    listing = f"`airflow-arroyo epochs {pipeline_id}`"
    if record.state in (EpochState.PRUNED, EpochState.PRUNING):
        raise ConfigurationError(
            f"epoch {epoch} of pipeline {pipeline_id!r} was pruned by retention: its snapshot is gone; read a "
            f"retained completed epoch ({listing}), and pin an epoch you want to read later "
            f"(`airflow-arroyo pin {pipeline_id} N --label ...`)")
    if record.state is not EpochState.COMPLETED:
        raise ConfigurationError(
            f"epoch {epoch} of pipeline {pipeline_id!r} is {record.state.value}, not completed: only a completed "
            f"epoch is a consistent cut with a snapshot of every stage; read a completed epoch ({listing})")
    stages = list(record.stages or pipe.stages)
    if stage not in stages:
        raise NotFoundError(f"pipeline {pipeline_id!r} has no stage {stage!r} in epoch {epoch}; its stages are "
                            f"{', '.join(stages) or 'none'}")
    ack = next((a for a in store.acks(pipeline_id, epoch) if a.stage == stage), None)
    batch_id = None if ack is None else (ack.details or {}).get("batch_id")
    if not isinstance(batch_id, int):
        raise ConfigurationError(
            f"epoch {epoch} of pipeline {pipeline_id!r} records no cut batch for stage {stage!r} (an epoch of a "
            f"release before acknowledgements carried it); read a later epoch ({listing})")
    if batch_id < 0:
        raise ConfigurationError(
            f"stage {stage!r} had not run a micro-batch when epoch {epoch} of pipeline {pipeline_id!r} cut it (batch "
            f"-1): there is no state yet; read a later epoch ({listing})")
    entries = store.snapshot_entries(pipeline_id, epoch, stage)
    operators = state_operators(e.rel_path for e in entries)
    if not operators:
        stateful = [s for s in stages if s != stage
                    and state_operators(e.rel_path for e in store.snapshot_entries(pipeline_id, epoch, s))]
        raise ConfigurationError(
            f"stage {stage!r} of pipeline {pipeline_id!r} holds no state (its query has no stateful operator): "
            + (f"read one of its stateful stages: {', '.join(stateful)}" if stateful
               else f"no stage of it holds state in epoch {epoch}"))
    where = storage_uri or pipe.storage_uri
    if not where:
        raise ConfigurationError(f"pipeline {pipeline_id!r} has no storage URI registered: pass the one its driver "
                                 "ran with (storage_uri=..., --storage-uri)")
    return StateCut(pipeline_id, epoch, stage, batch_id, where, tuple(operators),
                    state_bytes((e.rel_path, e.object_key, e.bytes) for e in entries))


def local_spark() -> SparkSession:
    """The active Spark session, or a local one with the provider's settings
    (:func:`~airflow_arroyo.jvm.local_master_conf`) for reading state from a command line."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # Python workers must run this interpreter (its packages); a user's own setting stands
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from airflow_arroyo.jvm import local_master_conf

    builder = SparkSession.builder.master("local[2]").appName("airflow-arroyo-state")
    confs = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "2", **local_master_conf()}
    for key, value in confs.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


@contextlib.contextmanager
def _rebuilt(store: EpochStore, cut: StateCut, scratch_uri: str | None) -> Iterator[str]:
    """The cut's checkpoint rebuilt into a fresh scratch folder, deleted afterwards (a local temporary folder, or a
    new folder below ``scratch_uri``); yields its URI as Spark spells it."""
    from airflow_arroyo.runtime.snapshot import SnapshotStore

    local = tempfile.mkdtemp(prefix=f"arroyo-state-{cut.epoch}-") if scratch_uri is None else None
    root = FileSystem.from_uri(local or str(scratch_uri))
    folder = "" if local else f"arroyo-state-{cut.pipeline_id}-{cut.epoch}-{uuid.uuid4().hex[:8]}"
    checkpoint = f"{folder}/{_CHECKPOINT}" if folder else _CHECKPOINT
    try:
        snapshots = SnapshotStore(FileSystem.from_uri(cut.storage_uri), cut.pipeline_id, store, checkpoints=root)
        try:
            snapshots.rebuild(cut.stage, cut.epoch, checkpoint)
        except SnapshotError as exc:
            raise SnapshotError(f"cannot read the state of stage {cut.stage!r} as of epoch {cut.epoch}: {exc}",
                                epoch=cut.epoch, path=exc.path) from exc
        yield root.spark_uri_of(checkpoint)
    finally:
        if local:
            shutil.rmtree(local, ignore_errors=True)
        else:
            root.delete_tree(folder)


def state_metadata(store_or_dsn: EpochStore | str, pipeline_id: str, epoch: int, stage: str, *,
                   spark: SparkSession | None = None, storage_uri: str | None = None,
                   scratch_uri: str | None = None) -> list[dict[str, Any]]:
    """Spark's ``state-metadata`` of the stage's checkpoint as of ``epoch``: one dict per operator and state
    store (``operatorId``, ``operatorName``, ``stateStoreName``, ``numPartitions``, ``minBatchId``, ...)."""
    with _opened(store_or_dsn) as store:
        cut = resolve_state(store, pipeline_id, epoch, stage, storage_uri=storage_uri)
        session = spark or local_spark()
        with _rebuilt(store, cut, scratch_uri) as path:
            return [r.asDict(recursive=True) for r in session.read.format("state-metadata").load(path).collect()]


def read_state(store_or_dsn: EpochStore | str, pipeline_id: str, epoch: int, stage: str, *,
               spark: SparkSession | None = None, operator_id: int | None = None, store_name: str | None = None,
               options: Mapping[str, str] | None = None, storage_uri: str | None = None,
               scratch_uri: str | None = None) -> DataFrame:
    """The state of ``stage`` as of completed epoch ``epoch``: Spark's state data source rows (``key``,
    ``value``, ``partition_id``), materialised in ``spark`` (default: the active session, or a local one).

    ``operator_id``: the stateful operator to read (needed when the stage's query has several; the refusal lists
    them with their names). ``store_name``: the operator's state store (Spark's default when None).
    ``options``: further options of Spark's state data source (e.g. ``stateVarName`` for a
    ``transformWithState`` operator, ``joinSide`` for a stream-stream join). ``storage_uri``: where the snapshot
    objects are, when not the pipeline's registered storage. ``scratch_uri``: where to rebuild the checkpoint when
    the session's executors cannot read this machine's temporary folder (a cluster: a shared ``hdfs://`` or object
    store URI); a folder of its own is made below it and deleted before return."""
    with _opened(store_or_dsn) as store:
        cut = resolve_state(store, pipeline_id, epoch, stage, storage_uri=storage_uri)
        session = spark or local_spark()
        with _rebuilt(store, cut, scratch_uri) as path:
            operator = _operator(session, cut, path, operator_id)
            reader = (session.read.format("statestore").option("path", path).option("batchId", str(cut.batch_id))
                      .option("operatorId", str(operator)))
            if store_name is not None:
                reader = reader.option("storeName", store_name)
            for key, value in (options or {}).items():
                reader = reader.option(key, value)
            # the rows must outlive the scratch folder, which is deleted on return
            return reader.load().localCheckpoint(eager=True)


def _operator(spark: SparkSession, cut: StateCut, path: str, wanted: int | None) -> int:
    if wanted is not None and wanted in cut.operators:
        return wanted
    if wanted is None and len(cut.operators) == 1:
        return cut.operators[0]
    rows = spark.read.format("state-metadata").load(path).collect()
    names = sorted({(int(r["operatorId"]), str(r["operatorName"])) for r in rows})
    listed = ", ".join(f"{i} ({name})" for i, name in names) or ", ".join(map(str, cut.operators))
    what = f"has no stateful operator {wanted}" if wanted is not None else "has several stateful operators"
    raise ConfigurationError(f"stage {cut.stage!r} of pipeline {cut.pipeline_id!r} {what} in epoch {cut.epoch}: "
                             f"choose one of {listed} (operator_id=..., --operator ID)")


def diff_state(before: DataFrame, after: DataFrame) -> DataFrame:
    """The keys whose state differs between two reads of one operator's state (:func:`read_state`): one row per
    key with ``change`` (``added``, ``removed`` or ``changed``) and its ``before`` and ``after`` values (null
    where the key is absent). Keys whose value is the same are left out."""
    from pyspark.sql import functions as F

    old = before.select("key", F.col("value").alias("before"), F.lit(True).alias("_in_before"))
    new = after.select("key", F.col("value").alias("after"), F.lit(True).alias("_in_after"))
    joined = old.join(new, on="key", how="full_outer")
    change = (F.when(F.col("_in_before").isNull(), F.lit(ADDED))
              .when(F.col("_in_after").isNull(), F.lit(REMOVED))
              .when(~F.col("before").eqNullSafe(F.col("after")), F.lit(CHANGED)))
    return (joined.select("key", change.alias("change"), "before", "after")
            .where(F.col("change").isNotNull()))


def diff_counts(diff: DataFrame) -> dict[str, int]:
    """How many keys :func:`diff_state` found added, removed and changed (every kind present, 0 when none)."""
    counts = {ADDED: 0, REMOVED: 0, CHANGED: 0}
    for row in diff.groupBy("change").count().collect():
        counts[str(row["change"])] = int(row["count"])
    return counts


def read_state_diff(store_or_dsn: EpochStore | str, pipeline_id: str, before: int, after: int, stage: str, *,
                    spark: SparkSession | None = None, operator_id: int | None = None,
                    store_name: str | None = None, options: Mapping[str, str] | None = None,
                    storage_uri: str | None = None, scratch_uri: str | None = None) -> DataFrame:
    """:func:`diff_state` of ``stage``'s state as of epochs ``before`` and ``after`` (both checked as
    :func:`read_state` checks one)."""
    with _opened(store_or_dsn) as store:
        session = spark or local_spark()
        reads = [read_state(store, pipeline_id, n, stage, spark=session, operator_id=operator_id,
                            store_name=store_name, options=options, storage_uri=storage_uri, scratch_uri=scratch_uri)
                 for n in (before, after)]
    return diff_state(*reads)
