"""An exactly-once Delta Lake table sink: the executors write each micro-batch's Parquet files into the table's
folder, and the driver commits an epoch's files to the Delta log in one commit carrying the pipeline's
application transaction.

**Why Delta Lake, through delta-rs.** Iceberg publishes no Spark runtime for Spark 4.2 (``iceberg-spark-runtime``
stops at ``4.1_2.13``), and pyiceberg cannot take files Spark wrote without rewriting them. Delta publishes one
(``io.delta:delta-spark_4.2_2.13:4.4.0``), but committing a set of files written earlier goes through its
internal ``DeltaLog`` API, and it reads only with ``DeltaSparkSessionExtension`` and ``DeltaCatalog`` set when
the session starts (static settings that would change every session the provider starts). The ``deltalake``
package (delta-rs, the ``[delta]`` extra) has the public API this protocol needs: a commit of files already
written (``create_write_transaction`` with add actions), Delta's ``SetTransaction`` (an application id and
version in the commit: ``transaction_version(app_id)`` is the last batch the table holds, Delta's own way to
make a streaming write idempotent), ``restore(version)`` with its own transaction, commit metadata, and
put-if-absent commits of the log (optimistic concurrency: a commit based on an old version fails). The files
are written by Spark's own Parquet writer on the executors and never copied; the driver only writes the log.

Layout in the table's folder (any URI both :class:`~airflow_arroyo.core.fs.FileSystem` and delta-rs understand)::

    <table>/_delta_log/                          the Delta log (the table, for every Delta reader)
    <table>/<batch:012d>-g<G>/part-*.parquet     a micro-batch's files, written at pre-commit (then data files)
    <table>/_arroyo_sink/owner.json              {"pipeline": ..., "stage": ...}: the one writer
    <table>/_arroyo_sink/batches/<batch:012d>-g<G>.json   {"rows": n}: the batch is complete, and its row count
    <table>/_arroyo_sink/claim-g<G>              a run's claim: older generations' pre-commits are refused

* **Pre-commit** (the sink stage's ``foreachBatch``, micro-batch *b*, generation *G*): ``df.write.parquet`` from
  the executors into ``<b>-g<G>/`` (overwrite: a re-run replaces), then the batch's row count (an observed
  metric of the write itself) into ``batches/``: written last, it says the batch is complete. No Delta reader
  sees these files: a Delta table is what its log names.
* **Commit** (the driver, when an epoch whose sink cut is *c* completes): ``M`` = the table's
  ``transaction_version("arroyo.<pipeline>.<sink>")`` (``-1``: none). If ``c <= M`` the commit is already in the
  table (a retry after a crash between the commit and the driver's record): nothing is committed again.
  Otherwise ONE Delta commit adds the files of every batch in ``(M, c]`` (per batch, the folder of the highest
  generation not above this run's) with the transaction ``(app id, c)`` and commit metadata ``arroyo.pipeline``,
  ``arroyo.sink``, ``arroyo.batch`` = *c*, ``arroyo.generation``, ``arroyo.rows``. Readers see a whole epoch or
  nothing of it (a Delta commit is one log file, put if absent). The table is created at the first commit from
  the first batch's Parquet schema.
* **Rollback** (restore of an epoch whose cut is *r*): with ``M <= r``, commit ``(M, r]`` (the restored epoch
  completed; its commit may not have run). With ``M > r``: ``restore`` the table to the newest version whose
  ``arroyo.batch`` is at most *r* (its transaction set back to that batch, in the same commit), then commit the
  batches after it up to *r*. Batches after *r* that no version holds are deleted; those some version holds are
  left for Delta's ``VACUUM`` (time travel to those versions keeps working until then).
* **Fencing**: every commit of the sink carries its generation and is based on the version it checked: the
  newest ``arroyo.generation`` in the log must not be above its own, and the log's put-if-absent refuses a
  commit whose version another writer took in between (``max_commit_retries=0``: no silent rebase). A run's
  claim writes ``claim-g<G>`` (older pre-commits are refused) and, when the table exists, a commit without
  data carrying *G* and ``M``: from then on an older run's commit fails (it would be based on an older version,
  or it reads *G*), and is refused with :class:`~airflow_arroyo.core.exceptions.FencedError`.
* **Trim**: the row-count files of batches at or before the oldest completed epoch's cut are deleted (the data
  files are the table's).

What readers see: any Delta reader (delta-rs, DuckDB, Trino, Spark with ``io.delta:delta-spark_4.2_2.13:4.4.0``
and the Delta session settings) reads whole epochs only, and time travel to the version an Asset event names.
Without Delta's Spark jar, Spark reads the table's current files as Parquet through the log
(:func:`table_files`: ``spark.read.parquet(*table_files(uri))``), exact for this sink's tables (no deletion
vectors, no column mapping: they only add and remove whole files).
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_arroyo.core.exceptions import ArroyoError, ConfigurationError, FencedError
from airflow_arroyo.core.fs import FileSystem
from airflow_arroyo.runtime.sinks.base import SINK_META, SinkCommit, folder_owner, newest_generations

if TYPE_CHECKING:
    from collections.abc import Mapping

    from deltalake import DeltaTable
    from pyspark.sql import DataFrame

    from airflow_arroyo.store.records import FencingToken

__all__ = ["DeltaTarget", "TransactionalDeltaSink", "table_files", "table_version"]

log = logging.getLogger(__name__)

_META = SINK_META
_BATCHES = f"{_META}/batches"
_STAGED = re.compile(r"^(\d{12})-g(\d+)$")  # <table>/<batch>-g<generation>/
_MANIFEST = re.compile(r"^(\d{12})-g(\d+)\.json$")
_CLAIM = re.compile(r"^claim-g(\d+)$")
_KEY = "arroyo."  # commit metadata keys


@dataclass(frozen=True)
class DeltaTarget:
    """Where a Delta sink writes: the table's folder ``path`` (a local path or a URI delta-rs reaches, e.g.
    ``s3://bucket/table``). ``storage_options``: delta-rs storage settings (no secrets: those stay in the
    environment, which delta-rs reads, e.g. ``AWS_ACCESS_KEY_ID``)."""

    path: str
    storage_options: Mapping[str, str] = field(default_factory=dict)

    def problem(self) -> str | None:
        """What is wrong with this target (None: nothing), for the graph's validation."""
        if not isinstance(self.path, str) or not self.path.strip():
            return "path= must name the table's folder (a local path or a URI such as s3://bucket/table)"
        secret = [k for k in self.storage_options if any(w in k.lower() for w in ("secret", "password", "token"))]
        if secret:
            return (f"storage_options= holds {', '.join(sorted(secret))}: keep credentials in the driver's "
                    "environment (delta-rs reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the like), not in the "
                    "pipeline's code")
        try:
            import deltalake  # noqa: F401
        except ImportError:
            return "the Delta sink needs the deltalake package: pip install 'airflow-arroyo[delta]'"
        return None


def _table_uri(fs: FileSystem) -> str:
    return fs.uri.removeprefix("file://") if fs.is_local else fs.uri


def table_version(uri: str | FileSystem, storage_options: Mapping[str, str] | None = None) -> int | None:
    """The current version of the Delta table at ``uri`` (None: no table there)."""
    from deltalake import DeltaTable

    path = _table_uri(FileSystem.of(uri))
    if not DeltaTable.is_deltatable(path, dict(storage_options or {})):
        return None
    return int(DeltaTable(path, storage_options=dict(storage_options or {})).version())


def table_files(uri: str | FileSystem, version: int | None = None,
                storage_options: Mapping[str, str] | None = None) -> list[str]:
    """The data files of the Delta table at ``uri`` (at ``version``, default the current one), as URIs Spark reads:
    ``spark.read.parquet(*table_files(uri))`` is the table (whole epochs only) without Delta's Spark jar."""
    from deltalake import DeltaTable

    fs = FileSystem.of(uri)
    table = DeltaTable(_table_uri(fs), version=version, storage_options=dict(storage_options or {}))
    root = table.table_uri.rstrip("/")
    return [fs.spark_uri_of(uri[len(root) + 1:]) if uri.startswith(root + "/") else uri for uri in table.file_uris()]


class TransactionalDeltaSink:
    """The Delta table of one sink stage (see the module docstring)."""

    def __init__(self, pipeline_id: str, stage: str, target: DeltaTarget) -> None:
        self.pipeline_id = pipeline_id
        self.stage = stage
        self.target = target
        self.fs = FileSystem.from_uri(target.path)
        self.uri = self.fs.uri
        self.app_id = f"arroyo.{pipeline_id}.{stage}"
        self.token: FencingToken | None = None

    def __repr__(self) -> str:
        return f"TransactionalDeltaSink({self.pipeline_id}/{self.stage} -> {self.uri})"

    @property
    def generation(self) -> int:
        """The fencing generation this sink writes with (0 without a token)."""
        return self.token.generation if self.token is not None else 0

    # ------------------------------------------------------------------ the table

    def _options(self) -> dict[str, str]:
        return dict(self.target.storage_options)

    def _table(self) -> DeltaTable | None:
        from deltalake import DeltaTable

        path = _table_uri(self.fs)
        if not DeltaTable.is_deltatable(path, self._options()):
            return None
        return DeltaTable(path, storage_options=self._options())

    def _committed(self, table: DeltaTable | None) -> int:
        """``M``: the last batch the table holds (its application transaction; -1 for none)."""
        if table is None:
            return -1
        version = table.transaction_version(self.app_id)
        return int(version) if version is not None else -1

    def _ours(self, table: DeltaTable, limit: int | None = None) -> list[dict[str, Any]]:
        """This sink's commits (their commit info), newest first."""
        return [h for h in table.history(limit) if h.get(f"{_KEY}sink") == self.stage
                and h.get(f"{_KEY}pipeline") == self.pipeline_id]

    def _table_generation(self, table: DeltaTable) -> int:
        """The newest generation that committed to the table (0 for none)."""
        ours = self._ours(table, 20) or self._ours(table)
        return max((int(h.get(f"{_KEY}generation", 0)) for h in ours[:1]), default=0)

    def _metadata(self, batch_id: int, rows: int | None) -> dict[str, str]:
        return {f"{_KEY}pipeline": self.pipeline_id, f"{_KEY}sink": self.stage, f"{_KEY}batch": str(batch_id),
                f"{_KEY}generation": str(self.generation), f"{_KEY}rows": "" if rows is None else str(rows)}

    def _properties(self, batch_id: int, rows: int | None) -> Any:
        from deltalake import CommitProperties, Transaction

        return CommitProperties(custom_metadata=self._metadata(batch_id, rows), max_commit_retries=0,
                                app_transactions=[Transaction(self.app_id, batch_id)])

    # ------------------------------------------------------------------ checks

    def owner(self) -> dict[str, str] | None:
        """Who claimed the table's folder (pipeline, stage), or None."""
        return folder_owner(self.fs)

    def check_writable(self) -> None:
        """Refuse (before anything is written) a folder another pipeline or stage writes, a Delta table this sink
        did not create, or a folder holding other files."""
        current = self.owner()
        if current is not None:
            if (current.get("pipeline"), current.get("stage")) != (self.pipeline_id, self.stage):
                raise ConfigurationError(
                    f"sink {self.stage!r} of pipeline {self.pipeline_id!r}: the Delta table {self.uri} is written by "
                    f"stage {current.get('stage')!r} of pipeline {current.get('pipeline')!r}; a table has one "
                    "exactly-once writer: choose another path")
            return
        if self._table() is not None:
            raise ConfigurationError(
                f"sink {self.stage!r}: {self.uri} is a Delta table this sink did not create; give the sink a new "
                "path (it creates the table from the output's schema and rolls it back on restore)")
        if any(not e.name.startswith(("_", ".")) for e in self.fs.list_dir()):
            raise ConfigurationError(
                f"sink {self.stage!r}: {self.uri} already holds files this sink did not write; give the sink an "
                "empty or new folder for its Delta table")

    def has_state(self) -> bool:
        """Whether an earlier run pre-committed or committed anything."""
        return self.owner() is not None and (bool(self._staged()) or self._table() is not None)

    def public_after(self, batch_id: int) -> int | None:  # noqa: ARG002 - the protocol's signature
        """None: a rollback takes back whatever was committed after ``batch_id`` (a restore of the table)."""
        return None

    # ------------------------------------------------------------------ phases

    def claim(self) -> None:
        """Record this sink as the folder's writer; with a fencing token, fence older generations out (a claim
        file, and a commit without data carrying the generation when the table exists)."""
        self.check_writable()
        if self.owner() is None:
            self.fs.write_json_atomic(f"{_META}/owner.json", {"pipeline": self.pipeline_id, "stage": self.stage})
        if not self.generation:
            return
        self.fs.write_bytes_atomic(f"{_META}/claim-g{self.generation}", b"")
        table = self._table()
        if table is not None and self._table_generation(table) < self.generation:
            committed = self._checked(table, "the claim")
            self._commit(table, [], committed, rows=0, what="the claim")

    def write_batch(self, df: DataFrame, batch_id: int) -> None:
        """Pre-commit micro-batch ``batch_id``: Parquet files from the executors, then its row count."""
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        self._check_claims(f"the pre-commit of micro-batch {batch_id}")
        folder = _staged_name(batch_id, self.generation)
        observation = Observation(f"arroyo_rows_{uuid.uuid4().hex}")
        observed = df.observe(observation, F.count(F.lit(1)).alias("rows"))
        observed.write.mode("overwrite").parquet(self.fs.spark_uri_of(folder))
        rows = observation.get.get("rows")
        self.fs.write_json_atomic(f"{_BATCHES}/{folder}.json", {"rows": int(rows) if rows is not None else None})

    def commit_through(self, batch_id: int) -> SinkCommit:
        """One Delta commit of every pre-committed batch in ``(M, batch_id]`` (nothing when the table already
        holds ``batch_id``: a retried commit is never made twice); says what it made visible and the version."""
        table = self._table()
        committed = self._checked(table, f"the commit through micro-batch {batch_id}")
        if batch_id <= committed:
            return SinkCommit(files=0, bytes=0, rows=0, batches=())
        batches = sorted(b for b in self._newest_staged() if committed < b <= batch_id)
        return self._commit(table, batches, batch_id, rows=None, what=f"the commit through micro-batch {batch_id}")

    def rollback_to(self, batch_id: int) -> None:
        """Keep exactly the batches ``<= batch_id`` in the table (``-1``: none), all committed."""
        table = self._table()
        committed = self._checked(table, f"the rollback to micro-batch {batch_id}")
        if table is not None and committed > batch_id:
            version, holds = self._version_holding(table, batch_id)
            table.restore(version, commit_properties=self._properties(holds, None))
            log.info("pipeline=%s sink=%s: restored the Delta table %s to version %s (batches <= %s)",
                     self.pipeline_id, self.stage, self.uri, version, holds)
            table = self._table()
        self.commit_through(batch_id)
        in_table = set() if table is None else {b for b in self._staged() if b <= max(committed, batch_id)}
        for b, gens in self._staged().items():
            for g in gens:
                if b > batch_id and b not in in_table:  # never committed: nothing refers to them
                    self.fs.delete_tree(_staged_name(b, g))
                if b > batch_id:
                    self.fs.delete(f"{_BATCHES}/{_staged_name(b, g)}.json")

    def trim_through(self, batch_id: int) -> None:
        """Delete the row counts of batches ``<= batch_id`` (committed; their files are the table's)."""
        for e in self.fs.list_dir(_BATCHES):
            m = _MANIFEST.match(e.name)
            if m is not None and int(m.group(1)) <= batch_id:
                self.fs.delete(e.path)

    def close(self) -> None:
        """Nothing kept open between calls (the table is read through Spark's session)."""

    # ------------------------------------------------------------------ helpers

    def _checked(self, table: DeltaTable | None, what: str) -> int:
        """``M``, after refusing a run older than the table's newest committer or claim."""
        self._check_claims(what)
        if table is not None:
            newest = self._table_generation(table)
            if newest > self.generation:
                raise self._fenced(newest, what)
        return self._committed(table)

    def _commit(self, table: DeltaTable | None, batches: list[int], through: int, *, rows: int | None,
                what: str) -> SinkCommit:
        import pyarrow.parquet as pq
        from deltalake import DeltaTable
        from deltalake.transaction import AddAction

        staged = self._newest_staged()
        adds: list[Any] = []
        total_rows: int | None = 0 if rows is None else rows
        now = int(time.time() * 1000)
        for b in batches:
            folder = staged[b]
            count = self._rows(folder)
            total_rows = total_rows + count if total_rows is not None and count is not None else None
            for e in self.fs.list_files(folder):
                if not any(part.startswith(("_", ".")) for part in e.path.split("/")):
                    with self.fs.open_input(e.path) as f:  # the footer's row count: Delta's numRecords statistic
                        stats = json.dumps({"numRecords": pq.read_metadata(f).num_rows})
                    adds.append(AddAction(e.path, e.size, {}, now, True, stats))
        if table is None:
            if not adds:
                return SinkCommit(files=0, bytes=0, rows=0, batches=tuple(batches))
            schema = pq.read_schema(self.fs.open_input(adds[0].path))
            try:
                DeltaTable.create(_table_uri(self.fs), schema=schema, storage_options=self._options(),
                                  commit_properties=self._properties(-1, 0))
            except Exception as exc:  # delta-rs raises DeltaError: another run created it meanwhile?
                raise self._conflict(exc, what) from exc
            table = self._table()
            assert table is not None
        try:
            table.create_write_transaction(adds, "append", table.schema(),
                                           commit_properties=self._properties(through, total_rows))
        except Exception as exc:  # a version taken in between (another writer), a bad schema
            raise self._conflict(exc, what) from exc
        table.update_incremental()
        version = int(table.version())
        size = sum(int(a.size) for a in adds)
        if batches:
            log.info("pipeline=%s sink=%s: committed batches %s..%s to the Delta table %s as version %s (%d files, "
                     "%s rows)", self.pipeline_id, self.stage, batches[0], through, self.uri, version, len(adds),
                     total_rows)
        return SinkCommit(files=len(adds), bytes=size, rows=total_rows, batches=tuple(batches), version=version)

    def _conflict(self, exc: BaseException, what: str) -> ArroyoError:
        """What a failed log write means: a newer run took the version (fenced), or something else."""
        table = self._table()
        newest = self._table_generation(table) if table is not None else 0
        claims = self._claims()
        newest = max(newest, *claims) if claims else newest
        if newest > self.generation:
            return self._fenced(newest, what)
        return ConfigurationError(f"sink {self.stage!r}: {what} of the Delta table {self.uri} failed: {exc}")

    def _version_holding(self, table: DeltaTable, batch_id: int) -> tuple[int, int]:
        """The newest version of this sink whose table held batches ``<= b`` for the largest ``b <= batch_id``."""
        for h in self._ours(table):
            held = int(h[f"{_KEY}batch"])
            if held <= batch_id:
                return int(h["version"]), held
        raise ConfigurationError(
            f"sink {self.stage!r}: no version of the Delta table {self.uri} holds batches <= {batch_id} any more (its "
            "log was cleaned up); restore a later epoch, or keep the table's log (delta.logRetentionDuration) as long "
            "as the epochs")

    def _rows(self, folder: str) -> int | None:
        try:
            value = self.fs.read_json(f"{_BATCHES}/{folder}.json")
        except FileNotFoundError:
            raise ConfigurationError(
                f"sink {self.stage!r}: micro-batch folder {folder} of {self.uri} has no completion record; the "
                "pre-commit of an epoch's batch did not finish") from None
        rows = (value or {}).get("rows")
        return int(rows) if rows is not None else None

    def _staged(self) -> dict[int, set[int]]:
        """Complete pre-committed batches: batch -> generations."""
        out: dict[int, set[int]] = {}
        for e in self.fs.list_dir(_BATCHES):
            m = _MANIFEST.match(e.name)
            if m is not None:
                out.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return out

    def _newest_staged(self) -> dict[int, str]:
        """Per batch, the folder of the highest generation not above this run's (a newer run's re-run wins)."""
        return {b: _staged_name(b, g) for b, g in newest_generations(self._staged(), self.generation).items()}

    def _claims(self) -> list[int]:
        return [int(m.group(1)) for e in self.fs.list_dir(_META) if (m := _CLAIM.match(e.name)) is not None]

    def _check_claims(self, what: str) -> None:
        if not self.generation:
            return
        newest = max(self._claims(), default=0)
        if newest > self.generation:
            raise self._fenced(newest, what)

    def _fenced(self, newest: int, what: str) -> FencedError:
        token = self.token
        return FencedError(self.pipeline_id, token.run_id if token else None, self.generation, by_generation=newest,
                           what=f"{what} of sink {self.stage!r} ({self.uri})")


def _staged_name(batch_id: int, generation: int) -> str:
    return f"{batch_id:012d}-g{generation}"
