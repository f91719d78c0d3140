"""An exactly-once file sink: Spark's batch file writers with a two-phase commit over epochs.

Spark's own streaming file sink remembers batch ids in ``_spark_metadata`` and skips a batch id it has
seen; after a restore the same batch id can carry other rows, so it would lose or duplicate them. This
sink instead follows Flink's two-phase commit sink: a micro-batch is *pre-committed* to a pending
folder, and *committed* (made visible) only when an epoch whose cut covers it completes. A restore
rolls it back to the restored epoch's cut. Readers of the sink's folder see whole epochs only.

Layout under the sink's ``path`` (any URI :class:`~airflow_arroyo.fs.FileSystem` understands)::

    <path>/<batch:012d>-<part file>          committed data files (what readers read)
    <path>/_arroyo_sink/owner.json           {"pipeline": ..., "stage": ..., "format": ...}
    <path>/_arroyo_sink/pending/<batch>/     a pre-committed micro-batch, as Spark's batch writer left it

Spark, pyarrow and pandas skip files and folders starting with ``_`` or ``.``, so ``_arroyo_sink`` is
invisible to readers of ``<path>``.

* **Pre-commit** (the stage's writer, micro-batch *b*): ``df.write.mode("overwrite")`` into
  ``pending/b``: a re-run of *b* after a restore replaces what an earlier attempt left.
* **Commit** (the driver, when epoch *n* completes, with *c* = the sink stage's cut batch of *n*):
  every ``pending/b`` with ``b <= c`` is moved into ``<path>`` file by file under names prefixed by
  *b*, then removed. Moving is idempotent: a commit cut short by a crash is finished by the next one.
* **Rollback** (restore of epoch *N*, cut *c*): finish the commit of ``pending/b <= c`` (epoch *N*
  completed; its commit may not have run), delete ``pending/b > c`` and committed files of batches
  ``> c`` (left by epochs after *N* when an older epoch is restored).
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

__all__ = ["FILE_SINK_FORMATS", "SinkCommit", "TransactionalFileSink"]

log = logging.getLogger(__name__)

# Spark batch writers that write files into a folder (what ships with pyspark; avro needs a jar).
FILE_SINK_FORMATS = frozenset({"parquet", "orc", "json", "csv", "text"})
_META = "_arroyo_sink"
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
        """Make every pending batch ``<= batch_id`` visible; returns what was moved."""
        moved = size = 0
        rows: int | None = 0
        batches = []
        for b in self.pending_batches():
            if b > batch_id:
                continue
            folder = self._pending(b)
            batches.append(b)
            counted = self._manifest_rows(folder)
            rows = rows + counted if rows is not None and counted is not None else None
            for e in self.fs.list_files(folder):
                rel = e.path[len(folder) + 1:] if e.path.startswith(folder + "/") else e.path
                if any(_hidden(part) for part in rel.split("/")):
                    continue  # _SUCCESS, .crc files, an unfinished _temporary, the batch manifest
                self.fs.move(e.path, self._committed_name(b, rel))
                moved += 1
                size += e.size
            self.fs.delete_tree(folder)
        if moved:
            log.info("pipeline=%s sink=%s: committed batches <= %s (%d files, %d bytes, %s rows) to %s",
                     self.pipeline_id, self.stage, batch_id, moved, size, rows, self.uri)
        return SinkCommit(files=moved, bytes=size, rows=rows if batches else 0, batches=tuple(batches))

    def _manifest_rows(self, folder: str) -> int | None:
        path = f"{folder}/{_BATCH_MANIFEST}"
        if not self.fs.exists(path):
            return None  # pre-committed by an older version, or the count was lost
        rows = (self.fs.read_json(path) or {}).get("rows")
        return int(rows) if rows is not None else None

    def rollback_to(self, batch_id: int) -> None:
        """Restore: keep exactly the batches ``<= batch_id`` (``-1``: nothing), all of them committed."""
        self.commit_through(batch_id)
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
    def _committed_name(batch_id: int, rel: str) -> str:
        folder, name = posixpath.split(rel)  # partitioned writes keep their key=value folders
        return posixpath.join(folder, f"{batch_id:0{_BATCH_DIGITS}d}-{name}")
