"""An exactly-once file sink: Spark's batch file writers with a two-phase commit over epochs.

Spark's own streaming file sink remembers batch ids in ``_spark_metadata`` and skips a batch id it has
seen; after a restore the same batch id can carry other rows, so it would lose or duplicate them. This
sink instead follows Flink's two-phase commit sink: a micro-batch is *pre-committed* to a pending
folder, and *committed* (made visible) only when an epoch whose cut covers it completes. A restore
rolls it back to the restored epoch's cut.

Layout under the sink's ``path`` (any URI :class:`~airflow_arroyo.fs.FileSystem` understands)::

    <path>/<batch:012d>-<part file>                committed data files (what readers read)
    <path>/_arroyo_sink/owner.json                 {"pipeline": ..., "stage": ..., "format": ...}
    <path>/_arroyo_sink/pending/<batch>/           a pre-committed micro-batch, as Spark's batch writer left it
    <path>/_arroyo_sink/committed/<batch:012d>.json  the batch's manifest: {"batch": b, "files": [...]}
    <path>/_arroyo_sink/committed.json             {"through": c}: the newest committed batch (the commit point)

Spark, pyarrow and pandas skip files and folders starting with ``_`` or ``.``, so ``_arroyo_sink`` is
invisible to readers of ``<path>``.

* **Pre-commit** (the stage's writer, micro-batch *b*): ``df.write.mode("overwrite")`` into
  ``pending/b``: a re-run of *b* after a restore replaces what an earlier attempt left.
* **Commit** (the driver, when epoch *n* completes, with *c* = the sink stage's cut batch of *n*):
  every file of every ``pending/b`` with ``b <= c`` is moved into ``<path>`` under a name prefixed by
  *b* (one file at a time: a rename on a local disk, a copy and a delete on an object store; no folder
  is renamed), then the batch's manifest is written and ``pending/b`` removed; last, ``committed.json``
  is rewritten with ``through = c``. Every step is idempotent: a commit cut short by a crash is
  finished by the next one, and a final name is written only from its one pending file, so no file
  ever appears under two names.
* **Rollback** (restore of epoch *N*, cut *c*): finish the commit of ``pending/b <= c`` (epoch *N*
  completed; its commit may not have run), set ``through = c``, then delete the manifests, pending
  folders and committed files of batches ``> c`` (left by epochs after *N* when an older epoch is
  restored).

What readers see. :func:`committed_files` lists exactly the files of the batches ``<= through``
(from their manifests): whole epochs only, on every backend, even while a commit runs or after a
crash in the middle of one. A plain reader of the folder (``spark.read.parquet(path)``,
``pyarrow.dataset``) lists the files themselves: it never sees a pending file (hidden folder) nor a
file twice, but while a commit is moving files (and, after a crash mid-commit, until the next run
finishes it) it can see part of an epoch; after a restore to an older epoch it stops seeing the later
epochs' files as they are deleted. On S3 that window is one copy request per file.
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING

from airflow_arroyo.exceptions import ConfigurationError
from airflow_arroyo.fs import FileSystem
from airflow_arroyo.runtime.sinks import SinkCommit

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

__all__ = ["FILE_SINK_FORMATS", "SinkCommit", "TransactionalFileSink", "committed_files"]

log = logging.getLogger(__name__)

# Spark batch writers that write files into a folder (what ships with pyspark; avro needs a jar).
FILE_SINK_FORMATS = frozenset({"parquet", "orc", "json", "csv", "text"})
_META = "_arroyo_sink"
_MANIFESTS = f"{_META}/committed"
_THROUGH = f"{_META}/committed.json"
_BATCH_DIGITS = 12
_BATCH_MANIFEST = "_arroyo_batch.json"  # in pending/<batch>/: {"rows": n}, written at pre-commit


def _hidden(name: str) -> bool:
    return name.startswith(("_", "."))


class TransactionalFileSink:
    """The files of one sink stage (see the module docstring)."""

    def __init__(self, pipeline_id: str, stage: str, fmt: str, options: Mapping[str, str]) -> None:
        if fmt not in FILE_SINK_FORMATS:
            raise ConfigurationError(
                f"sink {stage!r}: format {fmt!r} is not a file format this sink commits "
                f"({', '.join(sorted(FILE_SINK_FORMATS))})"
            )
        path = options.get("path")
        if not path:
            raise ConfigurationError(f"sink {stage!r}: format {fmt!r} needs options={{'path': '<folder or URI>'}}")
        self.pipeline_id = pipeline_id
        self.stage = stage
        self.format = fmt
        self.options = {k: v for k, v in options.items() if k != "path"}
        self.fs = FileSystem.from_uri(path)
        self.uri = self.fs.uri

    def __repr__(self) -> str:
        return f"TransactionalFileSink({self.pipeline_id}/{self.stage} -> {self.uri})"

    # ------------------------------------------------------------------ ownership

    def owner(self) -> dict[str, str] | None:
        try:
            value = self.fs.read_json(f"{_META}/owner.json")
        except FileNotFoundError:
            return None
        return dict(value) if isinstance(value, dict) else None

    def check_writable(self) -> None:
        """Refuse (before anything is written or rolled back) a folder another pipeline or stage writes,
        or one that holds files this sink did not write."""
        current = self.owner()
        if current is None:
            if any(not _hidden(e.name) for e in self.fs.list_dir()):
                raise ConfigurationError(
                    f"sink {self.stage!r}: {self.uri} already holds files this sink did not write; give the sink "
                    "an empty or new folder (its content is replaced epoch by epoch on restore)"
                )
            return
        if (current.get("pipeline"), current.get("stage")) != (self.pipeline_id, self.stage):
            raise ConfigurationError(
                f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: {self.uri} is written by stage "
                f"{current.get('stage')!r} of pipeline {current.get('pipeline')!r}; one folder has one writer: "
                "choose another path"
            )

    def claim(self) -> None:
        """Record this pipeline and stage as the folder's writer (after :meth:`check_writable`)."""
        self.check_writable()
        if self.owner() is None:
            self.fs.write_json_atomic(f"{_META}/owner.json",
                                      {"pipeline": self.pipeline_id, "stage": self.stage, "format": self.format})

    def has_state(self) -> bool:
        return self.owner() is not None and (bool(self.pending_batches()) or bool(self.committed_batches()))

    # ------------------------------------------------------------------ phases

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit micro-batch ``batch_id`` (overwrites an earlier attempt of the same batch), counting
        its rows on the way (an observed metric of the write itself: no second pass over the data)."""
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        target = self.fs.spark_uri_of(self._pending(batch_id))
        observation = Observation(f"arroyo_rows_{uuid.uuid4().hex}")
        observed = df.observe(observation, F.count(F.lit(1)).alias("rows"))
        observed.write.format(self.format).options(**self.options).mode("overwrite").save(target)
        rows = observation.get.get("rows")
        self.fs.write_json_atomic(f"{self._pending(batch_id)}/{_BATCH_MANIFEST}",
                                  {"rows": int(rows) if rows is not None else None})

    def commit_through(self, batch_id: int) -> SinkCommit:
        """Make every pending batch ``<= batch_id`` visible; says what it moved. The commit point is
        ``committed.json`` (written last); a commit cut short is finished by the next call."""
        pending = [b for b in self.pending_batches() if b <= batch_id]
        moved = size = 0
        rows: int | None = 0
        if pending:
            finals: dict[int, set[str]] = {}
            for b, path in self._committed_files():  # files an interrupted commit already moved
                finals.setdefault(b, set()).add(path)
            for b in pending:
                folder = self._pending(b)
                counted = self._manifest_rows(folder)
                rows = rows + counted if rows is not None and counted is not None else None
                for e in self.fs.list_files(folder):
                    rel = e.path[len(folder) + 1:] if e.path.startswith(folder + "/") else e.path
                    if any(_hidden(part) for part in rel.split("/")):
                        continue  # _SUCCESS, .crc files, an unfinished _temporary, the batch's row count
                    final = self._committed_name(b, rel)
                    self.fs.move(e.path, final)
                    finals.setdefault(b, set()).add(final)
                    moved += 1
                    size += e.size
                self.fs.write_json_atomic(self._manifest(b), {"batch": b, "files": sorted(finals.get(b, ()))})
                self.fs.delete_tree(folder)
        if pending or self._through() < batch_id:
            self.fs.write_json_atomic(_THROUGH, {"through": max(batch_id, self._through())})
        if moved:
            log.info("pipeline=%s sink=%s: committed batches <= %s (%d files, %d bytes, %s rows) to %s",
                     self.pipeline_id, self.stage, batch_id, moved, size, rows, self.uri)
        return SinkCommit(files=moved, bytes=size, rows=rows if pending else 0, batches=tuple(pending))

    def _manifest_rows(self, folder: str) -> int | None:
        path = f"{folder}/{_BATCH_MANIFEST}"
        if not self.fs.exists(path):
            return None  # pre-committed by an older version, or the count was lost
        rows = (self.fs.read_json(path) or {}).get("rows")
        return int(rows) if rows is not None else None

    def rollback_to(self, batch_id: int) -> None:
        """Restore: keep exactly the batches ``<= batch_id`` (``-1``: nothing), all of them committed."""
        self.commit_through(batch_id)
        self.fs.write_json_atomic(_THROUGH, {"through": batch_id})  # readers stop seeing later batches first
        for b in self._manifest_batches():
            if b > batch_id:
                self.fs.delete(self._manifest(b))
        for b in self.pending_batches():
            if b > batch_id:
                self.fs.delete_tree(self._pending(b))
        dropped = 0
        for b, path in self._committed_files():
            if b > batch_id:
                self.fs.delete(path)
                dropped += 1
        log.info("pipeline=%s sink=%s: rolled back to batch %s (%d committed files of later batches removed)",
                 self.pipeline_id, self.stage, batch_id, dropped)

    def trim_through(self, batch_id: int) -> None:
        """Nothing to forget: committed files are the sink's output, and a rollback deletes by batch id."""

    # ------------------------------------------------------------------ listing

    def pending_batches(self) -> list[int]:
        return sorted(int(e.name) for e in self.fs.list_dir(f"{_META}/pending") if e.is_dir and e.name.isdigit())

    def committed_batches(self) -> list[int]:
        return sorted({b for b, _ in self._committed_files()})

    def _committed_files(self) -> list[tuple[int, str]]:
        out = []
        for e in self.fs.list_files():
            if any(_hidden(part) for part in e.path.split("/")):
                continue
            head, _, _ = posixpath.basename(e.path).partition("-")
            if len(head) == _BATCH_DIGITS and head.isdigit():
                out.append((int(head), e.path))
        return out

    def _pending(self, batch_id: int) -> str:
        return f"{_META}/pending/{batch_id}"

    @staticmethod
    def _manifest(batch_id: int) -> str:
        return f"{_MANIFESTS}/{batch_id:0{_BATCH_DIGITS}d}.json"

    def _manifest_batches(self) -> list[int]:
        return _manifest_batches(self.fs)

    def _through(self) -> int:
        return _through(self.fs)

    @staticmethod
    def _committed_name(batch_id: int, rel: str) -> str:
        folder, name = posixpath.split(rel)  # partitioned writes keep their key=value folders
        return posixpath.join(folder, f"{batch_id:0{_BATCH_DIGITS}d}-{name}")


def _manifest_batches(fs: FileSystem) -> list[int]:
    names = [e.name.removesuffix(".json") for e in fs.list_dir(_MANIFESTS) if e.name.endswith(".json")]
    return sorted(int(n) for n in names if n.isdigit())


def _through(fs: FileSystem) -> int:
    try:
        return int(fs.read_json(_THROUGH)["through"])
    except FileNotFoundError:
        return -1


def committed_files(uri: str) -> list[str]:
    """The data files of a file sink folder that belong to committed epochs (paths relative to ``uri``, in
    batch order): what a reader that must never see part of an epoch reads, e.g.
    ``spark.read.parquet(*[f"{uri}/{p}" for p in committed_files(uri)])``."""
    fs = FileSystem.from_uri(uri)
    through = _through(fs)
    out: list[str] = []
    for b in _manifest_batches(fs):
        if b <= through:
            out.extend(fs.read_json(TransactionalFileSink._manifest(b))["files"])
    return out
