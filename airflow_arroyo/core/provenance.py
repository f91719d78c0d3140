"""Provenance per epoch: which input each epoch read, what it snapshotted and what each sink committed for it.

Everything is read from what the epoch store and the snapshot objects already hold (no schema of its own):

* **Input ranges.** Each stage's cut batch *b* (its acknowledgement's ``batch_id``) names Spark's offset log
  entry ``offsets/<b>`` in the epoch's snapshot: a version line, a metadata line, then one JSON line per source,
  the end offsets (inclusive of what the batch read). A stage's range in epoch *N* runs from its offsets at the
  previous completed epoch's cut (exclusive; none: from the source's start) to those at *N*'s cut (inclusive).
  The offsets are the source's own: ``{"topic": {"partition": offset}}`` for Kafka, ``{"id": n}`` for the
  generator, ``{"pos": n}`` for a channel, ``{"logOffset": n}`` for a file source, whose file names are read
  from its ``sources/<n>/<log offset>`` log (kept whole in every snapshot up to the cut).
* **Snapshot objects** per stage: how many files and bytes the epoch's snapshot references.
* **Sink commits** (``arroyo_sink_commits``): batch, files, rows, bytes and a Delta table's version; for an
  exactly-once file sink the committed file names, from the manifests of the batches the commit covered.

Reverse lookups: :func:`epoch_of_file` (a file sink's committed file -> its batch -> the commit that covered
it -> the epoch) and :func:`epoch_of_table_version`. Airflow-free: the CLI (``airflow-arroyo provenance``)
calls it.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from airflow_arroyo.core.epochs import EpochState
from airflow_arroyo.core.exceptions import ConfigurationError, NotFoundError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.layout import object_path
from airflow_arroyo.runtime.sinks.files import committed_files
from airflow_arroyo.runtime.spark_checkpoint import offsets_path

if TYPE_CHECKING:
    from airflow_arroyo.store import AckRecord, EpochRecord, PipelineRecord, SinkCommitRecord, SnapshotEntry

__all__ = ["EpochProvenance", "ProvenanceReads", "SinkProvenance", "SourceRange", "StageProvenance",
           "epoch_of_file", "epoch_of_table_version", "epoch_provenance", "parse_offset_log"]


class ProvenanceReads(Protocol):
    """The epoch store's reads provenance needs: an :class:`~airflow_arroyo.store.EpochStore` (the CLI), or the
    read-only :class:`~airflow_arroyo.store.reads.RecordReads` (the UI, on connections that cannot write)."""

    def get_pipeline(self, pipeline_id: str) -> PipelineRecord:
        """The pipeline's record."""

    def get_epoch(self, pipeline_id: str, epoch: int) -> EpochRecord:
        """The epoch's record."""

    def list_epochs(self, pipeline_id: str, *, limit: int = 100, before: int | None = None,
                    states: Iterable[EpochState] | None = None) -> list[EpochRecord]:
        """Epochs, newest first."""

    def acks(self, pipeline_id: str, epoch: int) -> list[AckRecord]:
        """The stages' acknowledgements of an epoch."""

    def snapshot_entries(self, pipeline_id: str, epoch: int, stage: str) -> list[SnapshotEntry]:
        """The files of a stage's snapshot of an epoch."""

    def sink_commits(self, pipeline_id: str, *, after_seq: int = 0, sink: str | None = None,
                     limit: int = 100) -> list[SinkCommitRecord]:
        """The sinks' commits, oldest first."""

_BATCH_DIGITS = 12  # a file sink's committed names start with the batch, zero-padded (runtime/sinks/files.py)


@dataclass(frozen=True)
class SourceRange:
    """One source of a stage's query in one epoch: its offsets after the previous completed epoch's cut
    (``start``, exclusive; None: from the source's start) through this epoch's cut (``end``, inclusive), and for a
    file source the files in between."""

    index: int
    start: dict[str, Any] | None
    end: dict[str, Any] | None
    files: list[str] | None = None


@dataclass(frozen=True)
class StageProvenance:
    """One stage in one epoch: its cut batch and the previous completed epoch's, its snapshot's objects (files)
    and bytes (each object counted once), and the range each of its query's sources covered."""

    stage: str
    batch_id: int | None
    previous_batch_id: int | None
    objects: int
    bytes: int
    sources: list[SourceRange] = field(default_factory=list)


@dataclass(frozen=True)
class SinkProvenance:
    """What one sink committed for the epoch: batches after ``previous_batch_id`` through ``batch_id``, their
    files, rows and bytes, the table version a Delta commit made, and a file sink's committed file names."""

    sink: str
    uri: str
    batch_id: int
    previous_batch_id: int | None
    files: int
    rows: int | None
    bytes: int
    table_version: int | None
    file_names: list[str] | None = None


@dataclass(frozen=True)
class EpochProvenance:
    """An epoch's provenance: per stage its input ranges and snapshot, per sink its commit. The ranges start at
    ``previous_epoch``'s cut, the newest epoch before it that completed (superseded ones excepted)."""

    pipeline_id: str
    epoch: int
    previous_epoch: int | None
    #: the previous epoch was pruned: its cut's offsets are gone, so each range's ``start`` is unknown (None)
    previous_pruned: bool
    stages: list[StageProvenance]
    sinks: list[SinkProvenance]

    def as_dict(self) -> dict[str, Any]:
        """As plain JSON-able values."""
        return asdict(self)


def parse_offset_log(text: str) -> list[dict[str, Any] | None]:
    """The per-source end offsets of one Spark offset log entry (``v1``, the metadata JSON, one line per source;
    ``-`` for a source without an offset yet)."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("v"):
        raise ConfigurationError("not a Spark offset log entry (no version line)")
    out: list[dict[str, Any] | None] = []
    for line in lines[2:]:
        parsed = None if line.strip() in ("", "-") else json.loads(line)
        out.append(parsed if isinstance(parsed, dict) else None)
    return out


def _file_log_entries(text: str) -> list[dict[str, Any]]:
    """The entries of one file-source log file (``v1`` then one JSON object per file)."""
    return [json.loads(line) for line in text.splitlines()[1:] if line.strip()]


class _Snapshot:
    """One stage's snapshot of one epoch, its files read from the snapshot objects."""

    def __init__(self, storage: FileSystem, pipeline_id: str, entries: list[SnapshotEntry]) -> None:
        self.storage, self.pipeline_id = storage, pipeline_id
        self.by_path = {e.rel_path: e for e in entries}

    def read(self, rel: str) -> str | None:
        e = self.by_path.get(rel)
        return None if e is None else self.storage.read_bytes(object_path(self.pipeline_id, e.object_key)).decode()

    def offsets(self, batch_id: int | None) -> list[dict[str, Any] | None]:
        text = None if batch_id is None or batch_id < 0 else self.read(offsets_path("", batch_id))
        return [] if text is None else parse_offset_log(text)

    def source_files(self, index: int, after: int, through: int) -> list[str]:
        """The files a file source's log lists for log offsets in (``after``, ``through``]: each log file is one
        batch; a ``.compact`` one holds every entry up to it, each with its ``batchId``."""
        prefix = f"sources/{index}/"
        out: list[str] = []
        for rel in sorted(self.by_path):
            if not rel.startswith(prefix):
                continue
            text = self.read(rel) or ""
            for entry in _file_log_entries(text):
                b = entry.get("batchId")
                if isinstance(b, int) and after < b <= through and isinstance(entry.get("path"), str):
                    out.append(entry["path"])
        return sorted(set(out))


def _storage(store: ProvenanceReads, pipeline_id: str, storage_uri: str | None) -> FileSystem:
    where = storage_uri or store.get_pipeline(pipeline_id).storage_uri
    if not where:
        raise ConfigurationError(f"pipeline {pipeline_id!r} has no storage URI registered: pass the one its driver "
                                 "ran with (storage_uri=..., --storage-uri)")
    return FileSystem.of(where)


def _cut_batches(store: ProvenanceReads, pipeline_id: str, epoch: int) -> dict[str, int | None]:
    out: dict[str, int | None] = {}
    for a in store.acks(pipeline_id, epoch):
        b = (a.details or {}).get("batch_id")
        out[a.stage] = b if isinstance(b, int) else None
    return out


def _superseded(store: ProvenanceReads, pipeline_id: str) -> set[int]:
    out: set[int] = set()
    before: int | None = None
    while True:
        page = store.list_epochs(pipeline_id, limit=500, before=before, states=[EpochState.SUPERSEDED])
        out |= {e.epoch for e in page}
        if len(page) < 500:
            return out
        before = page[-1].epoch


def _all_commits(store: ProvenanceReads, pipeline_id: str, sink: str | None = None) -> list[SinkCommitRecord]:
    """The sinks' commits in commit order, those of superseded epochs left out: a restore rolled their batches
    back, and the restored lineage's next commit covers the batches after the restored cut again."""
    out: list[SinkCommitRecord] = []
    after = 0
    while True:
        page = store.sink_commits(pipeline_id, after_seq=after, sink=sink, limit=500)
        out += page
        if len(page) < 500:
            break
        after = page[-1].seq
    undone = _superseded(store, pipeline_id)
    return [c for c in out if c.epoch not in undone]


def _previous_completed(store: ProvenanceReads, pipeline_id: str, epoch: int) -> tuple[int | None, bool]:
    """The newest epoch before ``epoch`` that completed (a superseded one's cut was undone by a restore), and
    whether retention pruned it since (its snapshot, so where the range starts, is gone)."""
    prev = store.list_epochs(pipeline_id, limit=1, before=epoch,
                             states=[EpochState.COMPLETED, EpochState.PRUNING, EpochState.PRUNED])
    if not prev:
        return None, False
    return prev[0].epoch, prev[0].state is not EpochState.COMPLETED


def _is_file_sink(commit: SinkCommitRecord) -> bool:
    if commit.table_version is not None:
        return False
    try:
        return FileSystem.of(commit.uri).exists("_arroyo_sink/committed")
    except ConfigurationError:  # no file system: a Kafka topic or a PostgreSQL table (``<dsn>#<table>``)
        return False


def epoch_provenance(store: ProvenanceReads, pipeline_id: str, epoch: int, *,
                     storage_uri: str | None = None) -> EpochProvenance:
    """What epoch ``epoch`` of ``pipeline_id`` read, snapshotted and committed. Refuses (naming the fix) an epoch
    that is not completed or was pruned: only a retained completed epoch has a snapshot to read ranges from."""
    record = store.get_epoch(pipeline_id, epoch)
    listing = f"`airflow-arroyo epochs {pipeline_id}`"
    if record.state in (EpochState.PRUNED, EpochState.PRUNING):
        raise ConfigurationError(f"epoch {epoch} of pipeline {pipeline_id!r} was pruned by retention: its snapshot "
                                 f"is gone; ask about a retained completed epoch ({listing})")
    if record.state is not EpochState.COMPLETED:
        raise ConfigurationError(f"epoch {epoch} of pipeline {pipeline_id!r} is {record.state.value}, not completed: "
                                 f"only a completed epoch has a cut of every stage; ask about one ({listing})")
    storage = _storage(store, pipeline_id, storage_uri)
    previous, previous_pruned = _previous_completed(store, pipeline_id, epoch)
    cuts = _cut_batches(store, pipeline_id, epoch)
    prev_cuts = _cut_batches(store, pipeline_id, previous) if previous is not None else {}
    stages: list[StageProvenance] = []
    for stage in sorted(cuts):
        entries = store.snapshot_entries(pipeline_id, epoch, stage)
        snap = _Snapshot(storage, pipeline_id, entries)
        prev_batch = prev_cuts.get(stage)
        end = snap.offsets(cuts[stage])
        start: list[dict[str, Any] | None] = []
        if previous is not None and not previous_pruned and prev_batch is not None and prev_batch >= 0:
            # the previous cut's offset entry: in its own snapshot (this one keeps only the last few entries)
            start = _Snapshot(storage, pipeline_id, store.snapshot_entries(pipeline_id, previous, stage)
                              ).offsets(prev_batch)
        ranges = []
        for i, e in enumerate(end):
            s = start[i] if i < len(start) else None
            files = None
            if e is not None and set(e) == {"logOffset"}:
                after = int(s["logOffset"]) if s is not None and "logOffset" in s else -1
                files = snap.source_files(i, after, int(e["logOffset"]))
            ranges.append(SourceRange(i, s, e, files))
        stages.append(StageProvenance(stage, cuts[stage], prev_batch, len(entries),
                                      sum({e.object_key: e.bytes for e in entries}.values()), ranges))
    sinks: list[SinkProvenance] = []
    commits = _all_commits(store, pipeline_id)
    for c in (c for c in commits if c.epoch == epoch):
        earlier = [p for p in commits if p.sink == c.sink and p.seq < c.seq]
        prev_b = earlier[-1].batch_id if earlier else None
        names = None
        if _is_file_sink(c):
            before = set(committed_files(c.uri, prev_b)) if prev_b is not None else set()
            names = [f for f in committed_files(c.uri, c.batch_id) if f not in before]
        sinks.append(SinkProvenance(c.sink, c.uri, c.batch_id, prev_b, c.files, c.rows_committed,
                                    c.bytes_committed, c.table_version, names))
    return EpochProvenance(pipeline_id, epoch, previous, previous_pruned, stages, sinks)


def _file_batch(name: str) -> int | None:
    head, _, _ = posixpath.basename(name).partition("-")
    return int(head) if len(head) == _BATCH_DIGITS and head.isdigit() else None


def epoch_of_file(store: ProvenanceReads, pipeline_id: str, path: str) -> SinkCommitRecord:
    """The commit (and so the epoch) that made a file sink's committed file visible. ``path``: the file's URI or
    path (absolute, or relative to its sink's folder). Raises NotFoundError naming why when none did."""
    batch = _file_batch(path)
    if batch is None:
        raise ConfigurationError(f"{path!r} is not a committed file of an exactly-once file sink (its name does not "
                                 "start with a batch number): give a data file below a file sink's folder")
    commits = _all_commits(store, pipeline_id)
    for sink in dict.fromkeys(c.sink for c in commits):
        mine = [c for c in commits if c.sink == sink]
        if not _is_file_sink(mine[-1]):
            continue
        root = FileSystem.of(mine[-1].uri)
        rel = path
        # a local sink's URI is file:///...; a local path names its files as well
        for prefix in {mine[-1].uri.rstrip("/") + "/", root.uri.rstrip("/") + "/",
                       root.uri.removeprefix("file://").rstrip("/") + "/"}:
            if path.startswith(prefix) and prefix != "/":
                rel = path[len(prefix):]
        if "://" in rel or rel.startswith("/"):
            continue  # a path below another folder
        # the covering commit: the first one whose batch reaches it (superseded epochs' commits are left out)
        covering = next((c for c in mine if c.batch_id >= batch), None)
        if covering is not None and rel in committed_files(root, covering.batch_id):
            return covering
    raise NotFoundError(f"no commit of pipeline {pipeline_id!r} made {path!r} visible: it is not a committed file "
                        "of any of its file sinks (see `airflow-arroyo provenance PIPELINE --epoch N` for what each "
                        "epoch committed)")


def epoch_of_table_version(store: ProvenanceReads, pipeline_id: str, sink: str, version: int) -> SinkCommitRecord:
    """The commit (and so the epoch) of table sink ``sink`` that made table version ``version``."""
    commits = _all_commits(store, pipeline_id, sink)
    if not commits:
        raise NotFoundError(f"pipeline {pipeline_id!r} recorded no commit of sink {sink!r}: name one of its sinks")
    match = [c for c in commits if c.table_version == version]
    if not match:
        known = sorted({c.table_version for c in commits if c.table_version is not None})
        raise NotFoundError(f"no epoch of pipeline {pipeline_id!r} made version {version} of sink {sink!r}'s table; "
                            f"its commits made versions {', '.join(map(str, known)) or 'none (not a table sink)'}")
    return match[-1]
