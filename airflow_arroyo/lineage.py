"""OpenLineage run events per completed epoch, built from its provenance (:mod:`airflow_arroyo.core.provenance`).

One run per epoch: a ``COMPLETE`` :class:`~openlineage.client.event_v2.RunEvent` of the job
``<pipeline_id>.epochs`` whose run id is derived from the pipeline and the epoch (:func:`epoch_run_id`), so
that a repeated event of the same epoch (a restarted triggerer) is the same run to a consumer. Its parent is the
pipeline's driver run (job ``<pipeline_id>``, run id :func:`pipeline_run_id`).

* **inputs**: the sources the epoch read (a stage reading a channel reads the pipeline's own output, not a
  dataset): Kafka topics (``kafka://host:port`` + topic, the namespace from ``kafka_namespace`` since Spark's
  offset log does not record the brokers), a file source's folder (``file`` or ``s3://bucket`` + path), any other
  source (the testing generator) as ``x-arroyo://<pipeline_id>`` + ``<stage>/<source index>``. Each carries the
  ``arroyo_sourceRange`` facet: offsets after the previous completed epoch's cut, through this one's, and a file
  source's file names.
* **outputs**: what the sinks committed for the epoch: file and Delta folders, PostgreSQL tables
  (``postgres://host:port`` + ``database.schema.table``), Kafka topics, each with the ``arroyo_sinkCommit``
  facet (batches, files, rows, bytes, table version, file names), the standard ``outputStatistics`` facet and,
  for a table version, ``version``.
* **run facets**: ``parent`` and ``arroyo_epoch`` (previous epoch, per stage its cut batch and snapshot objects
  and bytes, and their totals).

The events are built with the ``openlineage.client`` classes (installed with Airflow's OpenLineage provider, the
``[openlineage]`` extra); :func:`airflow_client` returns that provider's configured client, or None when the
provider is missing or disabled, and :func:`emit_settled_epochs` is the use case the checkpoint trigger runs
(docs/lineage.md: when an epoch is emitted, and why there).
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

import attr
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    InputDatasetFacet,
    OutputDatasetFacet,
    RunFacet,
    dataset_version_dataset,
    job_type_job,
    output_statistics_output_dataset,
    parent_run,
)

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ArroyoError
from airflow_arroyo.core.provenance import EpochProvenance, SinkProvenance, SourceRange, epoch_provenance

if TYPE_CHECKING:
    from airflow_arroyo.store import AsyncEpochStore, EpochRecord, EpochStore

__all__ = [
    "PRODUCER",
    "ArroyoEpochRunFacet",
    "ArroyoSinkCommitOutputFacet",
    "ArroyoSourceRangeInputFacet",
    "EpochLineage",
    "airflow_client",
    "emit_settled_epochs",
    "epoch_event",
    "epoch_run_id",
    "pipeline_run_id",
    "sink_dataset_name",
]

log = logging.getLogger(__name__)

PRODUCER = "https://github.com/airflow-arroyo/airflow-arroyo"
_FACETS_DOC = f"{PRODUCER}/blob/main/docs/lineage.md"
UNKNOWN_KAFKA = "kafka://unknown"
CATCH_UP = 20  # at a first look, at most this many of the newest completed epochs are (re)emitted
_RUN_IDS = uuid.UUID("6f1c1d2e-9a57-4c55-8d43-5b0e1f0a2a11")  # the uuid5 namespace of this provider's run ids


def epoch_run_id(pipeline_id: str, epoch: int) -> str:
    """The OpenLineage run id of an epoch: the same for every event of it (consumers dedupe by it)."""
    return str(uuid.uuid5(_RUN_IDS, f"{pipeline_id}/epoch/{epoch}"))


def pipeline_run_id(pipeline_id: str, run_id: str) -> str:
    """The OpenLineage run id of one driver run of a pipeline (the parent of its epochs' runs)."""
    return str(uuid.uuid5(_RUN_IDS, f"{pipeline_id}/run/{run_id}"))


# ---------------------------------------------------------------- facets


@attr.define
class ArroyoEpochRunFacet(RunFacet):  # field names in OpenLineage's camelCase: they are the JSON keys
    """The epoch: the previous completed epoch its ranges start after, per stage the cut batch (and the previous
    epoch's) and the snapshot's objects and bytes, and their totals."""

    pipelineId: str
    epoch: int
    previousEpoch: int | None
    previousPruned: bool
    snapshotObjects: int
    snapshotBytes: int
    stages: list[dict[str, Any]] = attr.field(factory=list)

    @staticmethod
    def _get_schema() -> str:
        return f"{_FACETS_DOC}#arroyo_epoch"


@attr.define
class ArroyoSourceRangeInputFacet(InputDatasetFacet):
    """The input range one source covered in the epoch: offsets after ``start`` (None: from the source's start)
    through ``end``, in the source's own form, and a file source's files."""

    stage: str
    sourceIndex: int
    start: dict[str, Any] | None
    end: dict[str, Any] | None
    files: list[str] | None = None

    @staticmethod
    def _get_schema() -> str:
        return f"{_FACETS_DOC}#arroyo_sourcerange"


@attr.define
class ArroyoSinkCommitOutputFacet(OutputDatasetFacet):
    """What one sink committed for the epoch: batches after ``previousBatchId`` through ``batchId``."""

    sink: str
    batchId: int
    previousBatchId: int | None
    files: int
    rows: int | None
    bytes: int
    tableVersion: int | None
    fileNames: list[str] | None = None

    @staticmethod
    def _get_schema() -> str:
        return f"{_FACETS_DOC}#arroyo_sinkcommit"


# ---------------------------------------------------------------- dataset names (OpenLineage's naming spec)


def _location_name(uri: str) -> tuple[str, str]:
    """A folder or file URI (or a local path) as OpenLineage's (namespace, name)."""
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("", "file"):
        return "file", unquote(parts.path) or "/"
    if scheme in ("s3", "s3a", "s3n"):  # Spark's S3A names the same bucket as s3://
        return f"s3://{parts.netloc}", unquote(parts.path).lstrip("/")
    return f"{scheme}://{parts.netloc}", unquote(parts.path)


def _postgres_name(uri: str) -> tuple[str, str]:
    """The PostgreSQL sink's ``<redacted DSN>#<table>`` as ``postgres://host:port`` and ``db.schema.table``."""
    dsn, _, table = uri.rpartition("#")
    if "://" in dsn:
        parts = urlsplit(dsn)
        host, port, db = parts.hostname or "localhost", parts.port or 5432, unquote(parts.path.lstrip("/"))
    else:  # key=value DSN
        kv = dict(p.split("=", 1) for p in dsn.split() if "=" in p)
        host, port, db = kv.get("host", "localhost"), int(kv.get("port", "5432")), kv.get("dbname", "")
    qualified = table if "." in table else f"public.{table}"
    return f"postgres://{host}:{port}", f"{db}.{qualified}"


def sink_dataset_name(uri: str) -> tuple[str, str]:
    """A sink's recorded URI as OpenLineage's (namespace, name): a Kafka topic, a PostgreSQL table, a folder."""
    if uri.startswith("kafka://"):
        parts = urlsplit(uri)
        return f"kafka://{parts.netloc}", parts.path.lstrip("/")
    if "#" in uri and (uri.startswith(("postgres://", "postgresql://")) or "://" not in uri.partition("#")[0]):
        return _postgres_name(uri)
    return _location_name(uri)


def _kafka_topics(offsets: Mapping[str, Any] | None) -> list[str]:
    """The topics of a Kafka source's offsets (``{"topic": {"partition": offset}}``), else none."""
    if not offsets or not all(isinstance(v, Mapping) for v in offsets.values()):
        return []
    return sorted(offsets)


def _source_inputs(pipeline_id: str, stage: str, source: SourceRange, kafka_namespace: str) -> list[InputDataset]:
    """The datasets one source of a stage read in the epoch (none for a channel: the pipeline's own data)."""
    end = source.end or {}
    if set(end) == {"pos"}:
        return []
    facet = ArroyoSourceRangeInputFacet(stage=stage, sourceIndex=source.index, start=source.start,
                                        end=source.end, files=source.files, producer=PRODUCER)
    facets: dict[str, InputDatasetFacet] = {"arroyo_sourceRange": facet}
    if source.files is not None:  # a file source: its folder, when the epoch read any of its files
        folders = sorted({posixpath.dirname(f.rstrip("/")) for f in source.files})
        return [InputDataset(namespace=ns, name=name, inputFacets=facets)
                for ns, name in dict.fromkeys(_location_name(f) for f in folders)]
    topics = _kafka_topics(source.end) or _kafka_topics(source.start)
    if topics:
        return [InputDataset(namespace=kafka_namespace, name=t, inputFacets=facets) for t in topics]
    return [InputDataset(namespace=f"x-arroyo://{pipeline_id}", name=f"{stage}/{source.index}", inputFacets=facets)]


def _sink_output(sink: SinkProvenance) -> OutputDataset:
    namespace, name = sink_dataset_name(sink.uri)
    commit = ArroyoSinkCommitOutputFacet(sink=sink.sink, batchId=sink.batch_id, previousBatchId=sink.previous_batch_id,
                                         files=sink.files, rows=sink.rows, bytes=sink.bytes,
                                         tableVersion=sink.table_version, fileNames=sink.file_names, producer=PRODUCER)
    stats = output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
        rowCount=sink.rows, size=sink.bytes, fileCount=sink.files, producer=PRODUCER)
    outputs: dict[str, OutputDatasetFacet] = {"arroyo_sinkCommit": commit, "outputStatistics": stats}
    dataset_facets: dict[str, Any] = {}
    if sink.table_version is not None:
        dataset_facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=str(sink.table_version), producer=PRODUCER)
    return OutputDataset(namespace=namespace, name=name, facets=dataset_facets, outputFacets=outputs)


# ---------------------------------------------------------------- the event


def epoch_event(prov: EpochProvenance, *, namespace: str, event_time: datetime | None = None,
                run_id: str | None = None, kafka_namespace: str | None = None) -> RunEvent:
    """The ``COMPLETE`` run event of one epoch's provenance.

    :param namespace: the jobs' OpenLineage namespace (the provider's ``[openlineage] namespace``).
    :param event_time: when the epoch completed (default: now).
    :param run_id: the driver run that took the epoch: the parent run (None: no parent facet).
    :param kafka_namespace: ``kafka://host:port`` of the Kafka sources' cluster (default ``kafka://unknown``).
    """
    pid = prov.pipeline_id
    kafka = kafka_namespace or UNKNOWN_KAFKA
    inputs: list[InputDataset] = []
    for stage in prov.stages:
        for source in stage.sources:
            inputs += _source_inputs(pid, stage.stage, source, kafka)
    stages = [{"stage": s.stage, "batchId": s.batch_id, "previousBatchId": s.previous_batch_id,
               "objects": s.objects, "bytes": s.bytes} for s in prov.stages]
    run_facets: dict[str, RunFacet] = {"arroyo_epoch": ArroyoEpochRunFacet(
        pipelineId=pid, epoch=prov.epoch, previousEpoch=prov.previous_epoch, previousPruned=prov.previous_pruned,
        snapshotObjects=sum(s.objects for s in prov.stages), snapshotBytes=sum(s.bytes for s in prov.stages),
        stages=stages, producer=PRODUCER)}
    if run_id is not None:
        run_facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=pipeline_run_id(pid, run_id)), job=parent_run.Job(namespace=namespace, name=pid),
            producer=PRODUCER)
    job_type = job_type_job.JobTypeJobFacet(processingType="STREAMING", integration="ARROYO", jobType="EPOCH",
                                            producer=PRODUCER)
    when = (event_time or datetime.now(UTC)).astimezone(UTC)
    return RunEvent(eventType=RunState.COMPLETE, eventTime=when.isoformat(), producer=PRODUCER,
                    run=Run(runId=epoch_run_id(pid, prov.epoch), facets=run_facets),
                    job=Job(namespace=namespace, name=f"{pid}.epochs", facets={"jobType": job_type}),
                    inputs=inputs, outputs=[_sink_output(s) for s in prov.sinks])


# ---------------------------------------------------------------- emission


def airflow_client() -> tuple[Any, str] | None:
    """Airflow's OpenLineage provider's configured client and namespace (its ``[openlineage]`` transport and
    namespace), or None when the provider is not installed or OpenLineage is disabled."""
    try:
        from airflow.providers.openlineage import conf as ol_conf
        from airflow.providers.openlineage.plugins.listener import get_openlineage_listener
    except ImportError as exc:
        log.debug("no OpenLineage events of epochs: the OpenLineage provider is not installed (%s)", exc)
        return None
    if ol_conf.is_disabled():
        log.debug("no OpenLineage events of epochs: OpenLineage is disabled or has no transport configured")
        return None
    return get_openlineage_listener().adapter.get_or_create_openlineage_client(), ol_conf.namespace()


def _settled(completed: list[EpochRecord], after: int | None, *, final: bool) -> list[EpochRecord]:
    """The completed epochs (newest first, as listed) to emit now, oldest first. The newest one waits for the next
    epoch to complete (or the run to end, ``final``): its sinks' commits are recorded after it completes."""
    newest = completed[0].epoch if completed else None
    due = [e for e in completed if (after is None or e.epoch > after) and (final or e.epoch != newest)]
    if after is None:
        due = due[:CATCH_UP]
    return sorted(due, key=lambda e: e.epoch)


def emit_settled_epochs(store: EpochStore, pipeline_id: str, after: int | None, *, final: bool,
                        emit: Callable[[RunEvent], None], namespace: str,
                        kafka_namespace: str | None = None) -> int | None:
    """Emit the run event of every settled completed epoch after epoch ``after`` (None: a first look, which
    re-emits up to :data:`CATCH_UP` retained ones: the same run ids, so a consumer keeps one of each); returns the
    new position. Blocking: run it in a thread. An epoch whose provenance cannot be read (pruned meanwhile) or
    whose event the transport refused is logged and passed: lineage must never stop the pipeline's control."""
    completed = store.list_epochs(pipeline_id, limit=CATCH_UP + 1, states=[EpochState.COMPLETED])
    position = after
    for rec in _settled(completed, after, final=final):
        position = rec.epoch
        try:
            prov = epoch_provenance(store, pipeline_id, rec.epoch)
        except (ArroyoError, OSError) as exc:  # pruned meanwhile, or its snapshot objects unreadable
            log.warning("pipeline %s epoch %s: no OpenLineage event, its provenance cannot be read: %s", pipeline_id,
                        rec.epoch, exc)
            continue
        event = epoch_event(prov, namespace=namespace, event_time=rec.ended_at, run_id=rec.run_id,
                            kafka_namespace=kafka_namespace)
        try:
            emit(event)
        except Exception as exc:  # the transport's own (HTTP, Kafka, a file): best effort, as the provider's events
            log.warning("pipeline %s epoch %s: the OpenLineage transport failed: %s", pipeline_id, rec.epoch, exc,
                        exc_info=True)
            continue
        log.info("pipeline %s epoch %s: OpenLineage run event emitted (%s inputs, %s outputs)", pipeline_id,
                 rec.epoch, len(event.inputs or ()), len(event.outputs or ()))
    return position


class EpochLineage:
    """The checkpoint trigger's emitter of one pipeline's epoch events (docs/lineage.md). It looks when the count
    of completed epochs the trigger saw changes, and once more when the run ended (``final``); the store reads, the
    snapshot reads and the transport's send run in a worker thread, never on the triggerer's event loop."""

    def __init__(self, pipeline_id: str, *, kafka_namespace: str | None = None) -> None:
        self.pipeline_id = pipeline_id
        self.kafka_namespace = kafka_namespace
        self.after: int | None = None  # the newest epoch emitted (None: none yet, the first look catches up)
        self._seen = -1  # the completed count of the last look
        self._client: tuple[Any, str] | None | bool = False  # False: not resolved yet

    async def look(self, store: AsyncEpochStore, completed: int, *, final: bool = False) -> None:
        """Emit what settled since the last look (``completed``: how many epochs the trigger saw complete)."""
        if completed == self._seen and not final:
            return
        self._seen = completed
        try:
            self.after = await store.call(self._emit, self.after, final)
        except Exception as exc:  # lineage never fails the checkpoint controller; the next look tries again
            log.warning("pipeline %s: OpenLineage events not emitted: %s", self.pipeline_id, exc, exc_info=True)

    def _emit(self, store: EpochStore, after: int | None, final: bool) -> int | None:
        if self._client is False:
            self._client = airflow_client()  # reads Airflow's config (and maybe a connection): in this thread
        if not isinstance(self._client, tuple):
            return after
        client, namespace = self._client
        return emit_settled_epochs(store, self.pipeline_id, after, final=final, emit=client.emit,
                                   namespace=namespace, kafka_namespace=self.kafka_namespace)
